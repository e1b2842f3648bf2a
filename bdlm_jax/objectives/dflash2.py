"""DFlash2's draft losses (docs/dflash.md, "DFlash2"), after the seed's
`core/models/backbones/dflash/dflash2.py` (`DFlash2Model.distributed_dflash_loss`).

One streamed pass of the frozen head over the draft rows gives, per row, the cross-entropy
of the data token, its probability p = exp(-ce) and the head's exact top-K (ids and logits,
the selector's candidates). The slots' weights then read the whole block (D-PACE's products
run along it), so they are computed on the draft rows put back in logical order, [S, A, B],
through the layout's static permutation: the same weights under every strategy. Numerator
and denominator are sums over the whole batch (every rank's rows), as the seed's all-reduce.
"""

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.kernels.chunking import over_row_chunks
from bdlm_jax.models.transformer import head_logits

DPACE = ("dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")


def dpace_weights(p, supervised_mask, alpha, kind: str = "dpace"):
  """D-PACE weights [..., B] of the slots of draft blocks [..., B] (no gradient: the seed
  computes them under no_grad): s_j = (1 - alpha) p_j + alpha on supervised slots, 1
  elsewhere; C_j = prod_{i<=j} s_i; `dpace`: w_j = sum_{k>=j} C_k m_k; the ablations
  `dpace-cumulative-confidence-only` w_j = C_j and `dpace-continuation-value-only`
  w_j = (sum_{k>=j} C_k m_k) / C_j. The loss multiplies w by the mask m."""
  p = jax.lax.stop_gradient(jnp.asarray(p, jnp.float32))
  m = jnp.asarray(supervised_mask).astype(jnp.float32)
  s = jnp.where(m > 0, (1.0 - alpha) * p + alpha, 1.0)
  prefix = jnp.cumprod(s, axis=-1)
  if kind == "dpace-cumulative-confidence-only":
    return prefix
  suffix = jnp.flip(jnp.cumsum(jnp.flip(prefix * m, -1), -1), -1)
  if kind == "dpace":
    return suffix
  if kind == "dpace-continuation-value-only":
    return suffix / jnp.maximum(prefix, jnp.finfo(jnp.float32).tiny)
  raise ValueError(f"D-PACE kind {kind!r} is not one of {list(DPACE)}")


def streamed_rows(head, softcap: float, chunk: int, top_k: int, h_SND, labels_SN,
                  multiplier: float = 1.0):
  """Per row, in one pass of the head over chunks of `chunk` rows: (ce [S, N], top-K ids
  [S, N, K], top-K logits [S, N, K]) of the logits times `multiplier`, soft-capped (the
  seed's `dflash_linear_topk.py` ~126-147); K = 0 gives empty candidates. Only one chunk's logits
  exist at a time and the backward recomputes them (rematerialised chunks). The head is the
  frozen target's, so no weight gradient is summed over the chunks."""
  def per_row(h, labels):
    logits = head_logits(head, h, softcap, multiplier)
    gold = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    values, ids = jax.lax.top_k(logits, top_k)
    return (jax.nn.logsumexp(logits, axis=-1) - gold, ids, values), ()

  return over_row_chunks(per_row, chunk, h_SND, labels_SN, remat=True)[0]


def draft_index(plan) -> np.ndarray:
  """int [N]: the logical draft row (anchor j * B + slot k) of each row of every rank's
  noisy slot; A * B for padding and for the later copies of a row that a layout repeats
  (`first_copies`: every rank holds every draft block under a replicated-drafts plan), so
  each logical row is written once, by its scored copy."""
  rows = plan.slot_rows(plan.rows.reshape(1, -1), "noisy")[0].astype(np.int64)
  first = plan.slot_rows(plan.first_copies.reshape(1, -1), "noisy")[0]
  n = plan.draft_blocks * plan.block_size
  return np.where((rows >= 0) & (rows < n) & first, rows, n)


def to_blocks(plan, x_SN):
  """Noisy-slot rows [S, N] -> logical draft blocks [S, A, B] (padding rows dropped)."""
  idx = draft_index(plan)
  n = plan.draft_blocks * plan.block_size
  out = jnp.zeros((x_SN.shape[0], n), x_SN.dtype).at[:, idx].set(x_SN, mode="drop")
  return out.reshape(x_SN.shape[0], plan.draft_blocks, plan.block_size)


def from_blocks(plan, x_SAB):
  """Logical draft blocks [S, A, B] -> noisy-slot rows [S, N] (0 on padding rows)."""
  idx = draft_index(plan)
  flat = x_SAB.reshape(x_SAB.shape[0], -1)
  n = flat.shape[1]
  return jnp.where(idx < n, flat[:, np.minimum(idx, n - 1)], 0)


def rows_loss(spec, model, batch, hidden_SND, scored_SR, weight_SR):
  """(loss, metrics) of the draft rows under `objective.dflash_loss` (DFlash2's losses):
  (token numerator + selector_loss_alpha * selector numerator) / sum of the weights."""
  cfg, plan, o = spec.cfg, spec.plan, spec.cfg.objective
  noisy = lambda x: plan.slot_rows(x, "noisy")
  labels = noisy(batch.labels)
  m = noisy(scored_SR) & (labels >= 0)
  top_k = o.selector_top_k if o.selector_rank else 0

  ce, ids, unary = streamed_rows(model.head, cfg.model.logit_softcap, cfg.model.logits_chunk,
                                 top_k, hidden_SND, labels, cfg.model.output_multiplier)
  p = jnp.exp(-ce)
  mf = m.astype(jnp.float32)
  if o.dflash_loss == "dflash":
    w = mf * noisy(weight_SR)
  else:
    w_SAB = dpace_weights(to_blocks(plan, jnp.where(m, p, 0.0)), to_blocks(plan, mf),
                          o.dpace_alpha, o.dflash_loss)
    w = mf * from_blocks(plan, w_SAB)
  w = jax.lax.stop_gradient(w)
  ce_num = jnp.sum(jnp.where(m, w * ce, 0.0))
  tv_num = jnp.sum(jnp.where(m, w * (1.0 - p), 0.0))
  acceptance = jax.lax.stop_gradient(jnp.sum(jnp.where(m, p, 0.0)) / jnp.maximum(mf.sum(), 1))
  num = ce_num
  if o.lk_loss == "tv":
    num = tv_num
  elif o.lk_loss == "lambda":
    lam = o.kl_scale * jnp.exp(-o.kl_decay * acceptance)
    num = lam * ce_num + (1.0 - lam) * tv_num
  metrics = dict(target_probability=acceptance)
  if o.selector_rank:
    tokens_SAB = to_blocks(plan, noisy(batch.tokens))
    prev_SAB = jnp.concatenate([tokens_SAB[..., :1], tokens_SAB[..., :-1]], axis=-1)
    scores = model.drafter.selector(hidden_SND, from_blocks(plan, prev_SAB), ids, unary)
    match = ids == labels[..., None]
    covered = m & match.any(-1)
    gold = jnp.take_along_axis(scores, jnp.argmax(match, -1)[..., None], -1)[..., 0]
    selector_ce = jax.nn.logsumexp(scores, axis=-1) - gold
    num = num + o.selector_loss_alpha * jnp.sum(jnp.where(covered, w * selector_ce, 0.0))
    metrics["selector_coverage"] = covered.sum() / jnp.maximum(m.sum(), 1)
  return num / jnp.maximum(jnp.sum(w), jnp.finfo(jnp.float32).tiny), metrics
