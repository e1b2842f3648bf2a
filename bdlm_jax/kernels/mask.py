"""Row metadata and the BDLM attention mask (docs/objective.md, docs/local_and_moe.md).

Every attention implementation derives its mask from per-row metadata, never from row
order, so the same rule serves every layout (single device, CP zigzag, BP, CSBP). A sliding
window is metadata too: each query row carries the first key position it may see (`lo`), so
kernels and transports apply local layers' windows with no extra argument.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

NOISY, CLEAN = 0, 1
# A noisy *query* whose own block is causal: it sees that block's keys at positions <= its
# own only (a DFlash drafter's draft rows on sliding layers, `drafter.sliding_causal`). Only
# query metadata carries it; as a key such a row is noisy.
NOISY_CAUSAL = 2


class RowMeta(NamedTuple):
  """Per-row metadata, each int32 [S, R].

  stream: NOISY (x_t) or CLEAN (x_0); NOISY_CAUSAL on a query: noisy, own block causal.
  block:  block index (pos // B); for autoregressive attention block == pos.
  seg:    document id inside the packed sequence; 0 marks padding (never attends, never seen).
  pos:    position in the packed sequence (a token's noisy and clean rows share it).
  lo:     the first key position this row may attend to as a query: 0 on global layers,
          its window's start on local ones (`windowed`); None on rows used only as keys
          (`as_keys`), so that no transport moves it.
  """

  stream: jnp.ndarray
  block: jnp.ndarray
  seg: jnp.ndarray
  pos: jnp.ndarray
  lo: jnp.ndarray | None = None

  def slice_rows(self, start: int, stop: int) -> "RowMeta":
    return jax.tree.map(lambda x: x[:, start:stop], self)

  def concat(self, other: "RowMeta") -> "RowMeta":
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), self, other)


def as_keys(meta: RowMeta) -> RowMeta:
  """`meta` of rows that serve as keys: their window start is a query's concern only."""
  return meta._replace(lo=None)


def row_meta(stream, block, seg, pos) -> RowMeta:
  """RowMeta of global-attention rows (no window)."""
  return RowMeta(stream, block, seg, pos, pos * 0)


def windowed(meta: RowMeta, window: int, block_size: int) -> RowMeta:
  """`meta` with the sliding window of W = `window` positions (docs/local_and_moe.md).

  A noisy query of block b sees its own block and the clean keys at [bB - (W-1), bB); a clean
  query at p sees clean keys of blocks <= its own with p - pos(k) < W. Both are `pos(k) >= lo`
  on top of the global rules (a noisy query's own-block keys are never before bB).
  `block_size` is the positions per unit of `block`: B where blocks are numbered, 1 where a
  noisy row's block is its first position (objectives with BLOCK_IDS = "position").
  """
  start = jnp.where(meta.stream == NOISY, meta.block * block_size, meta.pos)
  return meta._replace(lo=start - (window - 1))


def allowed(q_meta: RowMeta, k_meta: RowMeta) -> jnp.ndarray:
  """bool [S, Rq, Rk]: may query row q attend to key row k ([Rq, Rk] for 1-D metadata).

  noisy->noisy: same block (bidirectional; a NOISY_CAUSAL query: keys at positions <= its
  own); noisy->clean: strictly earlier block; clean->clean: same or earlier block;
  clean->noisy: never; always within one document and never before the query's window start.
  """
  qs, qb, qg, qp, qlo = (x[..., :, None] for x in (q_meta.stream, q_meta.block, q_meta.seg,
                                                     q_meta.pos, q_meta.lo))
  ks, kb, kg, kp = (x[..., None, :] for x in (k_meta.stream, k_meta.block, k_meta.seg,
                                                k_meta.pos))
  same_doc = (qg == kg) & (qg > 0)
  noisy_q = qs != CLEAN
  own = (kb == qb) & ((qs == NOISY) | (kp <= qp))
  rule = jnp.where(
      noisy_q,
      jnp.where(ks != CLEAN, own, kb < qb),
      (ks == CLEAN) & (kb <= qb),
  )
  return same_doc & rule & (kp >= qlo)
