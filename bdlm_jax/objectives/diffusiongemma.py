"""DiffusionGemma's SFT objective: canvases corrupted with uniform tokens, self-conditioning,
and the clean stream's next-token loss (docs/diffusiongemma.md says where each choice comes
from).

The `[x_t ; x_0]` stream of BD3-LM, read as DiffusionGemma reads it: a block of the noisy
stream is a *canvas* (bidirectional inside, reading the clean stream of earlier blocks), the
clean stream is the *encoder* (causal), and both share every weight.

* Corruption: block b of sequence s draws t (antithetic over the batch's blocks, in
  [eps_min, eps_max]); each supervised token of the block is replaced, with probability t,
  by a token drawn uniformly from the vocabulary (which may be itself). No [MASK].
* Decoder loss: cross-entropy of *every* supervised canvas token (replaced or not), averaged
  in its block, over the sequence's supervised blocks, then over the sequences that have one.
* Encoder loss: the clean stream's next-token cross-entropy, averaged over its pairs, times
  `objective.encoder_loss_weight`. Pairs within one document, the prompt's included, but
  not those of the last block's clean rows: no canvas reads them, and `bp` does not lay them
  out (`LayoutPlan.counted_rows`), so leaving them out keeps every strategy's loss the same.
* Self-conditioning, where the model has the module (`model.self_conditioning`): every canvas
  row's input embedding passes it; a sequence drawn with probability
  `objective.self_condition_p` is conditioned on the softmax of a first pass's canvas logits
  (that pass as at the first denoising step: zero soft embeddings, and no gradient), the
  others on zeros. Both passes are the whole model over the layout, so under `csbp_*` the
  first moves only clean K/V too.

Every draw is made in logical coordinates (per sequence, block and position), so the loss is
the same under every layout; the weights above already normalise it (`normalizer` is 1).
"""

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import CLEAN, NOISY
from bdlm_jax.models.transformer import expected_embedding, head_logits
from bdlm_jax.objectives import ar
from bdlm_jax.objectives.base import check_block_size, over_layers
from bdlm_jax.objectives.bd3lm import draw_noise
from bdlm_jax.objectives.streams import logical_stream

NAME = "diffusiongemma"
LOSS_SLOT = "all"  # canvases (decoder loss) and the clean stream (encoder loss)
NOISY_STREAM = True
COPIES = 1
DRAFTER = False
SAMPLER = "canvas"
BLOCK_IDS = "position"  # the encoder is causal
TOKEN_SHIFT = False  # a canvas row predicts its own token
MASK_TOKEN = False  # uniform-token corruption: no id is reserved
FROZEN = ()
ATTEND_ROWS = ("all",)
score = ar.score  # weighted cross-entropy of the scored rows


def check_config(cfg: Config) -> None:
  check_block_size(cfg)
  if cfg.objective.self_condition_p > 0 and not cfg.model.self_conditioning:
    raise ConfigError(
        f"objective.self_condition_p={cfg.objective.self_condition_p} needs the "
        f"self-conditioning module (model.self_conditioning=true, as a DiffusionGemma import "
        f"sets it); set objective.self_condition_p=0 to train without self-conditioning")


def evaluated(cfg: ObjectiveConfig, t_min: float) -> dict:
  del cfg, t_min
  return {}


def normalizer(batch) -> float:
  del batch
  return 1.0


def first_passes(cfg: Config) -> int:
  """The self-conditioning pass, where the model has the module and some sequence draws it."""
  return int(cfg.model.self_conditioning and cfg.objective.self_condition_p > 0)


def logical_rows(tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig) -> dict:
  """Noisy row p: its own token, if supervised (not padding, not prompt); clean row p: token
  p + 1 of its document, outside the last block."""
  rows = logical_stream(tokens_SL, seg_SL)
  s, l = tokens_SL.shape
  supervised = (seg_SL > 0) & ~protected_SL
  pair = np.zeros((s, l), bool)
  pair[:, :-1] = (seg_SL[:, 1:] == seg_SL[:, :-1]) & (seg_SL[:, :-1] > 0)
  pair[:, l - cfg.block_size:] = False
  first = rows["pos"] // cfg.block_size * cfg.block_size  # BLOCK_IDS = "position"
  rows.update(block=np.where(rows["stream"] == NOISY, first, rows["pos"]),
              maskable=np.concatenate([supervised, np.zeros((s, l), bool)], 1),
              labels=np.concatenate([np.where(supervised, tokens_SL, -1),
                                     np.where(pair, np.roll(tokens_SL, -1, 1), -1)],
                                    1).astype(np.int32))
  return rows


def corrupt(key, batch, cfg: Config):
  """(batch, (inputs, self-conditioned [S]), scored, weight): every labelled row is scored,
  with the weight that makes the summed cross-entropy the loss."""
  o, seq_len = cfg.objective, cfg.data.seq_len
  k_noise, k_tokens, k_self = jax.random.split(key, 3)
  s = batch.tokens.shape[0]
  t_SN, u_SL = draw_noise(k_noise, s, seq_len, o)
  t_row = jnp.take_along_axis(t_SN, batch.pos // o.block_size, axis=1)
  u_row = jnp.take_along_axis(u_SL, batch.pos, axis=1)
  uniform_SL = jax.random.randint(k_tokens, (s, seq_len), 0, cfg.model.vocab_size)
  replaced = batch.maskable & (u_row < t_row)
  inputs = jnp.where(replaced, jnp.take_along_axis(uniform_SL, batch.pos, axis=1), batch.tokens)
  conditioned_S = jax.random.uniform(k_self, (s,)) < o.self_condition_p
  return batch, (inputs, conditioned_S), batch.labels >= 0, loss_weights(batch, cfg)


def loss_weights(batch, cfg: Config) -> jax.Array:
  """float32 [S, R]: 1 / (supervised tokens of its block x supervised blocks of its sequence x
  sequences with one) on a canvas row with a label; encoder_loss_weight / (labelled clean
  rows) on a clean one; 0 elsewhere."""
  labelled = batch.labels >= 0
  decoder, encoder = labelled & (batch.stream == NOISY), labelled & (batch.stream == CLEAN)
  block_SR = batch.pos // cfg.objective.block_size
  n_blocks = cfg.data.seq_len // cfg.objective.block_size
  per_block_SN = jax.vmap(lambda b, d: jax.ops.segment_sum(d, b, n_blocks))(
      block_SR, decoder.astype(jnp.float32))
  blocks_S = jnp.sum(per_block_SN > 0, axis=1)
  sequences = jnp.maximum(jnp.sum(blocks_S > 0), 1)
  in_block = jnp.maximum(jnp.take_along_axis(per_block_SN, block_SR, axis=1), 1.0)
  w_decoder = 1.0 / (in_block * jnp.maximum(blocks_S, 1)[:, None] * sequences)
  w_encoder = cfg.objective.encoder_loss_weight / jnp.maximum(jnp.sum(encoder), 1)
  return jnp.where(decoder, w_decoder, jnp.where(encoder, w_encoder, 0.0))


def hidden(spec, model, batch, inputs, layer_weights):
  """The model over every row, its canvas rows self-conditioned (module docstring)."""
  tokens, conditioned_S = inputs
  plan = spec.plan
  run = lambda x_BRD: over_layers(spec, model, batch, x_BRD, layer_weights)
  x = model.embed_tokens(tokens)
  if not spec.cfg.model.self_conditioning:
    hidden_BRD, stats = run(x)
    return hidden_BRD, (), stats
  canvas = plan.slot_rows(x, "noisy")
  soft = jnp.zeros_like(canvas)
  condition = lambda soft: plan.with_slot(x, model.self_condition(canvas, soft), "noisy")
  if first_passes(spec.cfg):
    first, _ = run(condition(soft))
    first = jax.lax.stop_gradient(plan.slot_rows(first, "noisy"))
    soft = soft_embeddings(spec, model, first) * conditioned_S[:, None, None].astype(soft.dtype)
  hidden_BRD, stats = run(condition(soft))
  return hidden_BRD, (), stats


def soft_embeddings(spec, model, h_SND) -> jax.Array:
  """`expected_embedding` of the logits of hidden states [S, N, D], on each device's rows in
  chunks of `model.logits_chunk` (one chunk's float32 [rows, vocab] softmax at a time)."""
  m = spec.cfg.model
  parts = -(-spec.plan.n_noisy // m.logits_chunk) if m.logits_chunk > 0 else 1

  def fn(readout, h):
    head, embed = readout
    logits = head_logits(head, h, m.logit_softcap)
    return expected_embedding(embed, logits, m.scale_embeddings).astype(h.dtype), ()

  return spec.rows(fn, max(parts, 1), (model.head, model.embed), h_SND)[0]
