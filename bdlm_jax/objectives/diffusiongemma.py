"""DiffusionGemma's SFT objective as the seed's native recipe trains it: canvases corrupted
with uniform tokens, self-conditioning, and the clean stream's next-token loss
(docs/diffusiongemma.md says where each choice comes from).

The `[x_t ; x_0]` stream of BD3-LM, read as DiffusionGemma reads it: a block of the noisy
stream is a *canvas* (bidirectional inside, reading the clean stream of earlier blocks), the
clean stream is the *encoder* (causal), and both share every weight. A packed sequence holds
several conversations (segments); a block that ends one and starts the next holds one canvas
of each.

* Corruption: t is antithetic over the batch's response blocks (those with a supervised
  token; `objective.antithetic=false`: independent), in [eps_min, eps_max]; each
  supervised token of a block is replaced, with probability t, by a token drawn uniformly
  from the vocabulary (which may be itself).
* Decoder loss: cross-entropy of *every* supervised canvas token (replaced or not), averaged
  in its canvas, over its conversation's canvases, then over the step's conversations.
* Encoder loss: the clean stream's next-token cross-entropy, averaged over the step's pairs,
  times `objective.encoder_loss_weight`. Pairs within one conversation, the prompt's
  included, but not those of the last block's clean rows: no canvas reads them, and `bp`
  does not lay them out (`LayoutPlan.counted_rows`), so leaving them out keeps every
  strategy's loss the same.
* Self-conditioning, where the model has the module (`model.self_conditioning`): every canvas
  row's input embedding passes it; a conversation drawn with probability
  `objective.self_condition_p` is conditioned on the soft embedding of a first pass's canvas
  logits (that pass as at the first denoising step: zero soft embeddings), computed without
  gradient and detached, the others on zeros. Both passes are the whole model over the
  layout, so under `csbp_*` the first moves only clean K/V too.
* Routers are frozen by default (`train.freeze=auto`).

Every draw is made in logical coordinates (per sequence, block, conversation and position),
so the loss is the same under every layout; the weights normalise it (`normalizer` is 1),
with the step's counts (`step_counts`), so that accumulated micro-batches add up to the
one big batch.
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
HELD_OUT = (f"{NAME} loss", "")  # its training loss: no likelihood bound
FREEZE = "routers"  # train.freeze=auto: the seed's native SFT freezes every router
ATTEND_ROWS = ("all",)
score = ar.score  # weighted cross-entropy of the scored rows


def check_config(cfg: Config) -> None:
  check_block_size(cfg)
  if cfg.objective.loss_weight != "unit":
    raise ConfigError(
        f"objective.loss_weight={cfg.objective.loss_weight!r}: diffusiongemma weighs every "
        f"canvas token alike (the seed's unit weights; its weights are per canvas, per "
        f"conversation and per batch instead); set objective.loss_weight=unit")
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
  p + 1 of its conversation, outside the last block. Conversations (segments) are numbered
  1.. in each sequence, so that per-conversation tables have at most L + 1 entries."""
  seg_SL = _conversations(seg_SL)
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


def _conversations(seg_SL: np.ndarray) -> np.ndarray:
  """Segment ids renumbered 1.. per sequence (0 stays padding, also the padding between a
  conversation's turns); a conversation must be one run of its id, padding aside (its weight
  and self-conditioning draw are per conversation)."""
  out = np.zeros_like(seg_SL)
  for i, row in enumerate(seg_SL):
    real = row > 0
    ids = row[real]
    starts = np.flatnonzero(np.diff(ids, prepend=-1))
    if len(np.unique(ids[starts])) != len(starts):
      raise ConfigError(f"diffusiongemma needs each conversation's tokens contiguous, but "
                        f"sequence {i} returns to a segment id after another one")
    out[i, real] = np.repeat(np.arange(1, len(starts) + 1), np.diff(np.append(starts, len(ids))))
  return out


def step_counts(batch) -> dict:
  """The conversations with a supervised canvas token and the encoder's pairs, over the batch
  given: what the weights divide by (an accumulated step passes the whole step's)."""
  decoder, encoder = _scored(batch)
  per_conversation = _per_conversation(batch.seg, decoder.astype(jnp.float32))
  return dict(conversations=jnp.sum(per_conversation > 0), pairs=jnp.sum(encoder),
              labelled=jnp.sum(batch.labels >= 0))


def _scored(batch):
  labelled = batch.labels >= 0
  return labelled & (batch.stream == NOISY), labelled & (batch.stream == CLEAN)


def _per_conversation(seg_SR, x_SR, reduce=jax.ops.segment_sum):
  """Sums (or another segment `reduce`) of x over each sequence's conversations, [S, R + 1]
  (index: its number; numbers are at most L <= R, `_conversations`)."""
  return jax.vmap(lambda g, x: reduce(x, g, seg_SR.shape[1] + 1))(seg_SR, x_SR)


def corrupt(key, batch, cfg: Config, counts=None):
  """(batch, (inputs, self-conditioned rows [S, R]), scored, weight): every labelled row is
  scored, with the weight that makes the summed cross-entropy the loss (`loss_weights`)."""
  o, seq_len = cfg.objective, cfg.data.seq_len
  k_noise, k_tokens, k_self = jax.random.split(key, 3)
  s = batch.tokens.shape[0]
  t_SN, u_SL = response_noise(k_noise, batch, cfg)
  t_row = jnp.take_along_axis(t_SN, batch.pos // o.block_size, axis=1)
  u_row = jnp.take_along_axis(u_SL, batch.pos, axis=1)
  uniform_SL = jax.random.randint(k_tokens, (s, seq_len), 0, cfg.model.vocab_size)
  replaced = batch.maskable & (u_row < t_row)
  inputs = jnp.where(replaced, jnp.take_along_axis(uniform_SL, batch.pos, axis=1), batch.tokens)
  # one draw per conversation (index: its number), read by each of its rows
  conditioned = jax.random.uniform(k_self, (s, seq_len + 1)) < o.self_condition_p
  conditioned_SR = jnp.take_along_axis(conditioned, batch.seg, axis=1)
  counts = step_counts(batch) if counts is None else counts
  return batch, (inputs, conditioned_SR), batch.labels >= 0, loss_weights(batch, cfg, counts)


def response_noise(key, batch, cfg: Config):
  """(t [S, N], u [S, L]): t antithetic over the batch's *response* blocks (those with a
  supervised token, in (sequence, block) order) as the seed draws it (`objective.antithetic`;
  false: one uniform per (sequence, block), the seed's `antithetic_sampling: false`), then
  clipped to [eps_min, eps_max]; u uniform per position. Logical coordinates: the same under
  every layout."""
  o, seq_len = cfg.objective, cfg.data.seq_len
  n_blocks = seq_len // o.block_size
  k_t, k_u = jax.random.split(key)
  if o.antithetic:
    response_SN = jax.vmap(lambda b, m: jax.ops.segment_max(m, b, n_blocks))(
        batch.pos // o.block_size, batch.maskable.astype(jnp.int32)) > 0
    rank = (jnp.cumsum(response_SN.reshape(-1)) - 1).reshape(response_SN.shape)
    n = jnp.maximum(jnp.sum(response_SN), 1)
    t = jnp.mod(jax.random.uniform(k_t, ()) + rank / n, 1.0)
  else:
    t = jax.random.uniform(k_t, (batch.tokens.shape[0], n_blocks))
  u_SL = jax.random.uniform(k_u, (batch.tokens.shape[0], seq_len))
  return t * (o.eps_max - o.eps_min) + o.eps_min, u_SL


def loss_weights(batch, cfg: Config, counts: dict) -> jax.Array:
  """float32 [S, R], the seed's native SFT weights: a canvas row with a label weighs
  1 / (supervised tokens of its canvas x its conversation's canvases x `conversations`); a
  labelled clean row encoder_loss_weight / `pairs`; 0 elsewhere. A canvas is one
  conversation's part of a block (a block may end one packed conversation and start the
  next); counts are the step's (`step_counts`)."""
  decoder, encoder = _scored(batch)
  l, b = cfg.data.seq_len, cfg.objective.block_size
  per_position = lambda f, x, at: jax.vmap(lambda x, i: f(x, i, l))(x, at)  # [S, L] tables
  # A canvas is named by a position: its block's first, or where its conversation's
  # supervision starts if later. That position lies in the canvas's conversation.
  first = jnp.take_along_axis(
      _per_conversation(batch.seg, jnp.where(decoder, batch.pos, l), jax.ops.segment_min),
      batch.seg, axis=1)
  canvas = jnp.minimum(jnp.maximum(batch.pos // b * b, first), l - 1)
  in_canvas_SL = per_position(jax.ops.segment_sum, decoder.astype(jnp.float32), canvas)
  conversation_SL = per_position(jax.ops.segment_max, batch.seg, batch.pos)
  canvases_SC = _per_conversation(conversation_SL, (in_canvas_SL > 0).astype(jnp.float32))
  w_decoder = 1.0 / (jnp.maximum(jnp.take_along_axis(in_canvas_SL, canvas, axis=1), 1.0)
                     * jnp.maximum(jnp.take_along_axis(canvases_SC, batch.seg, axis=1), 1.0)
                     * jnp.maximum(counts["conversations"], 1))
  w_encoder = cfg.objective.encoder_loss_weight / jnp.maximum(counts["pairs"], 1)
  return jnp.where(decoder, w_decoder, jnp.where(encoder, w_encoder, 0.0))



def hidden(spec, model, batch, inputs, layer_weights):
  """The model over every row, its canvas rows self-conditioned (module docstring)."""
  tokens, conditioned_SR = inputs
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
    first = plan.slot_rows(first, "noisy")
    # The seed's soft embedding is computed without gradient and detached: none reaches the
    # embedding or head through the first pass's logits either.
    conditioned = plan.slot_rows(conditioned_SR, "noisy")[..., None].astype(soft.dtype)
    soft = jax.lax.stop_gradient(soft_embeddings(spec, model, first)) * conditioned
  hidden_BRD, stats = run(condition(soft))
  return hidden_BRD, (), stats


def soft_embeddings(spec, model, h_SND) -> jax.Array:
  """`expected_embedding` of the logits of hidden states [S, N, D], on each device's rows in
  chunks of `model.logits_chunk` (one chunk's float32 [rows, vocab] softmax at a time)."""
  m = spec.cfg.model
  parts = -(-spec.plan.n_noisy // m.logits_chunk) if m.logits_chunk > 0 else 1

  def fn(readout, h):
    head, embed = readout
    logits = head_logits(head, h, m.logit_softcap, m.output_multiplier)
    return expected_embedding(embed, logits, m.scale_embeddings).astype(h.dtype), ()

  return spec.rows(fn, max(parts, 1), (model.head, model.embed), h_SND)[0]
