"""Row metadata and the BDLM attention mask (DESIGN.md section 2).

Every attention implementation derives its mask from per-row metadata, never from row
order, so the same rule serves every layout (single device, CP zigzag, BP, CSBP).
"""

from typing import NamedTuple

import jax.numpy as jnp

NOISY, CLEAN = 0, 1


class RowMeta(NamedTuple):
  """Per-row metadata, each int32 [S, R].

  stream: NOISY (x_t) or CLEAN (x_0).
  block:  block index (pos // B); for autoregressive attention block == pos.
  seg:    document id inside the packed sequence; 0 marks padding (never attends, never seen).
  """

  stream: jnp.ndarray
  block: jnp.ndarray
  seg: jnp.ndarray

  def slice_rows(self, start: int, stop: int) -> "RowMeta":
    return RowMeta(*(x[:, start:stop] for x in self))

  def concat(self, other: "RowMeta") -> "RowMeta":
    return RowMeta(*(jnp.concatenate([a, b], axis=1) for a, b in zip(self, other)))


def allowed(q_meta: RowMeta, k_meta: RowMeta) -> jnp.ndarray:
  """bool [S, Rq, Rk]: may query row q attend to key row k ([Rq, Rk] for 1-D metadata).

  noisy->noisy: same block (bidirectional); noisy->clean: strictly earlier block;
  clean->clean: same or earlier block; clean->noisy: never; always within one document.
  """
  qs, qb, qg = (x[..., :, None] for x in q_meta)
  ks, kb, kg = (x[..., None, :] for x in k_meta)
  same_doc = (qg == kg) & (qg > 0)
  noisy_q = qs == NOISY
  rule = jnp.where(
      noisy_q,
      jnp.where(ks == NOISY, kb == qb, kb < qb),
      (ks == CLEAN) & (kb <= qb),
  )
  return same_doc & rule
