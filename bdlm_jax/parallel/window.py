"""The windowed K/V exchange of local (sliding-window) layers (docs/local_and_moe.md).

On a local layer a rank's queries reach back at most W-1 positions (a noisy query from its
block's start, a clean one from itself), so a rank needs only the travelling K/V rows that its
windows cover, not every rank's. `exchange_plan` lists them statically, in NumPy from the
layout plan and W: for each ring distance d, the rows each rank sends to rank + d. The
exchange is one `ppermute` per distance that carries anything, `exchange_attend` then
attends over [own K/V ; received K/V] and autodiff returns the received rows' gradients to
their owners by the reverse `ppermute`s. Traffic is O(W x owned blocks), whatever L.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import RowMeta, as_keys, windowed
from bdlm_jax.parallel.layout import PAD, LayoutPlan


@dataclasses.dataclass(frozen=True, eq=False)
class ExchangePlan:
  """What each rank sends on a local layer.

  distances: the ring distances d whose `ppermute` (rank r -> r + d) carries rows
  send:      per distance, int32 [P, M_d]: indices into the sender's travelling rows
  valid:     per distance, bool [P, M_d]: False on the padding that evens the counts out
  """

  num_ranks: int
  distances: tuple[int, ...]
  send: tuple[np.ndarray, ...]
  valid: tuple[np.ndarray, ...]

  def rows_sent(self) -> int:
    """Rows each rank sends per layer forward (padding included): sum of the M_d."""
    return sum(s.shape[1] for s in self.send)

  def rows_needed(self) -> int:
    """The most rows one rank receives that some window of it reaches (no padding): what
    a perfectly ragged transfer would move."""
    return int(max(sum(v[(r - d) % self.num_ranks].sum()
                       for d, v in zip(self.distances, self.valid))
                   for r in range(self.num_ranks))) if self.distances else 0


def reached_rows(plan: LayoutPlan, window: int) -> np.ndarray:
  """bool [P, 2L]: the logical rows (noisy r < L, clean L + p) that some query of each rank
  may attend to on a local layer of window W, ignoring documents (a superset is safe)."""
  L, B, W = plan.seq_len, plan.block_size, window
  out = np.zeros((plan.num_ranks, 2 * L), bool)
  for r, rows in enumerate(plan.rows):
    rows = rows[rows != PAD]
    noisy, pos = rows < L, rows % L
    start = pos // B * B
    # Key intervals [lo, hi) in logical rows: a noisy query's own block (noisy) and the
    # clean window before it; a clean query's window up to its block's end.
    lo = np.concatenate([start[noisy], L + np.maximum(start[noisy] - (W - 1), 0),
                         L + np.maximum(pos[~noisy] - (W - 1), 0)])
    hi = np.concatenate([start[noisy] + B, L + start[noisy], L + start[~noisy] + B])
    cover = np.zeros(2 * L + 1, np.int64)
    np.add.at(cover, lo, 1)
    np.add.at(cover, hi, -1)
    out[r] = np.cumsum(cover)[:-1] > 0
  return out


def exchange_plan(plan: LayoutPlan, window: int) -> ExchangePlan:
  """The static plan of the windowed exchange for `plan`'s travelling rows and window W."""
  p, split = plan.num_ranks, plan.n_stay
  reached = reached_rows(plan, window)
  travel = plan.rows[:, split:]
  distances, send, valid = [], [], []
  for d in range(1, p):
    wanted = [np.flatnonzero((travel[src] != PAD) & reached[(src + d) % p][travel[src]])
              for src in range(p)]
    m = max(len(w) for w in wanted)
    if m == 0:
      continue
    distances.append(d)
    send.append(np.stack([np.pad(w, (0, m - len(w))) for w in wanted]).astype(np.int32))
    valid.append(np.stack([np.arange(m) < len(w) for w in wanted]))
  return ExchangePlan(p, tuple(distances), tuple(send), tuple(valid))


def exchange_attend(kernel, axis: str, exchange: ExchangePlan, split: int, chunk: int,
                    window: int, block_size: int, q, k, v, q_meta: RowMeta, k_meta: RowMeta):
  """(out, lse) of local queries on a local layer: own K/V plus the rows the plan brings.

  Runs inside shard_map over `axis`. The received rows are tagged as attention residuals, so
  under remat the backward reuses them instead of exchanging them again.
  """
  me, p = jax.lax.axis_index(axis), exchange.num_ranks
  k_meta = as_keys(k_meta)
  k_tr, v_tr, meta_tr = k[:, split:], v[:, split:], k_meta.slice_rows(split, k.shape[1])
  keys, values, metas = [k], [v], [k_meta]
  for d, send, valid in zip(exchange.distances, exchange.send, exchange.valid):
    idx = jnp.asarray(send)[me]
    ok = jnp.asarray(valid)[me]
    sent = jax.tree.map(lambda m: m[:, idx], meta_tr)
    rows = (k_tr[:, idx], v_tr[:, idx], sent._replace(seg=jnp.where(ok, sent.seg, 0)))
    rows = jax.lax.ppermute(rows, axis, [(i, (i + d) % p) for i in range(p)])
    rows = residuals.keep_exchanged(rows)
    keys.append(rows[0])
    values.append(rows[1])
    metas.append(rows[2])
  k_all, v_all = jnp.concatenate(keys, 1), jnp.concatenate(values, 1)
  meta_all = jax.tree.map(lambda *m: jnp.concatenate(m, 1), *metas)
  return kernel.attend(q, k_all, v_all, windowed(q_meta, window, block_size), meta_all, chunk)
