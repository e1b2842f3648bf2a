"""Fast-dLLM v2 (AR -> BDLM conversion): token shift and complementary masks.

Same `[x_t ; x_0]` stream and block mask as BD3-LM (docs/objective.md), with two changes:
* token shift: the logit of row i predicts token i+1, which keeps the AR model's "hidden i
  -> token i+1" head. Inside a block, noisy row i sees the [MASK] at i+1 and is scored on
  x_{i+1} when that input is masked. The first token of block b+1 is scored on the *clean*
  row of the last position of block b, which sees blocks 0..b clean (every earlier token,
  none masked, as the AR model did). That is exactly the row the sampler computes once
  block b is finished (sample.py), as the reference does: `generate` in the `modeling.py`
  of the Fast_dLLM_v2_7B release runs the finished block clean, block-causally, and takes
  the next block's first token from its last row. Its training `forward`, and the seed's
  (Turbo-dLLM 0.1.6, `core/objectives/fast_dllm_v2.py` ~157-158: `labels[:, :-1] =
  targets[:, 1:]` on the noisy copies), instead score that token on the last *noisy* row
  of block b, which sees block b partly masked: a context sampling never produces.
  `objective.boundary_row="noisy"` trains that way.
* complementary masks: each sequence is run twice, once with mask m and once with its
  complement on the maskable tokens, so every supervised token is scored exactly once per
  step; weights are 1 and the sum is divided by the number of supervised tokens. A token
  is scored in the copy that masks it, its block's first token included (its clean row is
  the same in both copies).

Labels are built on the host in logical coordinates: the first token of block b+1 labels
the clean row of position (b+1)B - 1, which a layout may put on another rank than the
block. Whether a label is scored depends on the noise of position i+1, which every row
reads from the logical noise tables by its position (so the corruption is the same under
every layout). Logits are taken on both streams (`LOSS_SLOT = "all"`).
The batch is doubled inside `corrupt`, not by `make_batch`: the two copies must share one
noise draw, and the host batch keeps the shape the data pipeline and `put_batch` expect.

The seed's recipe (`objective.boundary_row="noisy"`, `keep_mask_logit=True`,
`antithetic=False`): t independent per (sequence, block), clipped to [1e-3, 1] (~108-116;
its recipe's `antithetic_sampling: true` only asserts the complementary pair,
`training/run_spec.py` ~688-690), and the [MASK] logit kept in the softmax
(`core/objectives/training.py` ~235). docs/conversion_sft.md compares the two forms.
"""

import jax
import jax.numpy as jnp
import numpy as np

import bdlm_jax.objectives.bd3lm as bd3lm
from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.objectives.bd3lm import draw_noise
from bdlm_jax.objectives.base import (check_block_size, count_labels, model_hidden,
                                     no_first_pass, no_step_counts)
from bdlm_jax.objectives.streams import logical_stream

NAME = "fast_dllm_v2"
LOSS_SLOT = "all"  # noisy rows inside blocks, clean rows at the block ends
NOISY_STREAM = True
COPIES = 2  # complementary masks
DRAFTER = False
SAMPLER = "mask"
BLOCK_IDS = "index"
TOKEN_SHIFT = True
MASK_TOKEN = True
FROZEN = ()
HELD_OUT = (f"{NAME} loss", "")  # its training loss: no likelihood bound
FREEZE = ""
ATTEND_ROWS = ("all",)
hidden = model_hidden
normalizer = count_labels
first_passes = no_first_pass
step_counts = no_step_counts


def check_config(cfg: Config) -> None:
  check_block_size(cfg)


def evaluated(cfg: ObjectiveConfig, t_min: float) -> dict:
  del cfg, t_min
  return {}


def nelbo_config(cfg: ObjectiveConfig, t_min: float) -> dict:
  """t over [t_min, 1 - t_min]: both copies' noise levels (t and 1 - t) stay >= t_min."""
  del cfg
  return dict(eps_min=t_min, eps_max=1.0 - t_min)


def supervised_positions(seg_SL, protected_SL) -> np.ndarray:
  """bool [S, L]: tokens that are masked in one copy and scored from their predecessor.

  A token needs a predecessor in its own document (the first token of a document has no
  row to predict it) and must be neither padding nor protected (prompt).
  """
  same_doc_as_prev = np.zeros(seg_SL.shape, bool)
  same_doc_as_prev[:, 1:] = seg_SL[:, 1:] == seg_SL[:, :-1]
  return same_doc_as_prev & (seg_SL > 0) & ~protected_SL


def logical_rows(tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig) -> dict:
  """Label x_{i+1}, if i+1 is supervised, on noisy row i inside a block; at a block's last
  position on the clean row (`boundary_row="clean"`) or the noisy row ("noisy"). Noisy row
  i is maskable if position i is supervised ("clean"), or if it is neither padding nor
  protected ("noisy": the seed also masks a first token that nothing scores)."""
  rows = logical_stream(tokens_SL, seg_SL)
  sup_SL = supervised_positions(seg_SL, protected_SL)
  next_SL = np.full(tokens_SL.shape, -1, np.int32)
  next_SL[:, :-1] = np.where(sup_SL[:, 1:], tokens_SL[:, 1:], -1)
  none_SL = np.zeros(tokens_SL.shape, bool)
  if cfg.boundary_row == "noisy":
    maskable_SL, noisy_labels, clean_labels = (seg_SL > 0) & ~protected_SL, next_SL, -1
  else:
    block_end_L = np.arange(tokens_SL.shape[1]) % cfg.block_size == cfg.block_size - 1
    maskable_SL = sup_SL
    noisy_labels = np.where(block_end_L, -1, next_SL)
    clean_labels = np.where(block_end_L, next_SL, -1)
  rows.update(block=rows["pos"] // cfg.block_size,
              maskable=np.concatenate([maskable_SL, none_SL], 1),
              labels=np.concatenate([noisy_labels, np.broadcast_to(clean_labels, next_SL.shape)],
                                    1).astype(np.int32))
  return rows


def _interleave(a_SR, b_SR):
  """[S, R] x 2 -> [2S, R] as (a_0, b_0, a_1, b_1, ...): each data shard keeps its rows."""
  return jnp.stack([a_SR, b_SR], axis=1).reshape(-1, *a_SR.shape[1:])


def corrupt(key, batch, cfg: Config, counts=None):
  """Both complementary copies: (batch2, inputs, scored, weight), each with 2S sequences;
  every weight is 1.

  `hit` = "position p is masked in the first copy" = u_p < t_block(p), drawn in logical
  coordinates. Row r's input is masked when its own position hits (copy 1) or misses
  (copy 2); its logit is scored when position pos+1 does, for rows that have a label
  (a clean row's logit is the same in both copies: it is scored in one).
  """
  del counts  # the loss is divided by `normalizer`
  return corrupt_with(*draw_noise(key, batch.tokens.shape[0], cfg.data.seq_len, cfg.objective),
                      batch, cfg)


def corrupt_with(t_SN, u_SL, batch, cfg: Config):
  """`corrupt` from given logical noise tables (t [S, N], u [S, L]): position p is masked in
  the first copy where u_p < t of its block."""
  o, seq_len = cfg.objective, cfg.data.seq_len
  hit_SL = u_SL < jnp.repeat(t_SN, o.block_size, axis=1)
  hit_here = jnp.take_along_axis(hit_SL, batch.pos, axis=1)
  nxt = jnp.minimum(batch.pos + 1, seq_len - 1)
  hit_next = jnp.take_along_axis(hit_SL, nxt, axis=1)
  has_label = batch.labels >= 0
  masked = _interleave(batch.maskable & hit_here, batch.maskable & ~hit_here)
  inputs = jnp.where(masked, o.mask_token_id, _interleave(batch.tokens, batch.tokens))
  scored = _interleave(has_label & hit_next, has_label & ~hit_next)
  batch2 = jax.tree.map(lambda x: _interleave(x, x), batch)
  return batch2, inputs, scored, jnp.ones(scored.shape)


def nelbo_corrupt(key, batch, cfg: Config, counts=None):
  """`corrupt` with each copy weighted as a NELBO draw (likelihood.py): a row scored on
  position p + 1 weighs 1/(2t) in copy 1 (p + 1 masked where u < t) and 1/(2(1 - t)) in copy
  2 (masked at noise level 1 - t), t that of p + 1's block; the pair is antithetic."""
  del counts
  o, seq_len = cfg.objective, cfg.data.seq_len
  t_SN, u_SL = draw_noise(key, batch.tokens.shape[0], seq_len, o)
  batch2, inputs, scored, _ = corrupt_with(t_SN, u_SL, batch, cfg)
  t_row = jnp.take_along_axis(t_SN, jnp.minimum(batch.pos + 1, seq_len - 1) // o.block_size, 1)
  return batch2, inputs, scored, _interleave(0.5 / t_row, 0.5 / (1.0 - t_row))


score = bd3lm.score  # the SUBS cross-entropy of the scored rows, as in BD3-LM (weights are 1)
