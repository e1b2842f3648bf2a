"""Block-sparse tile maps: which (query tile, key tile) pairs of a BDLM mask a kernel visits.

Splash attention's "mask info" idea, derived from row metadata: each tile of rows is
summarised by the block range of its noisy rows, of its clean rows and its document range;
comparing two summaries with the rules of kernels/mask.py classifies the tile pair as

  EMPTY    no pair may attend: never visited
  FULL     every pair attends: visited without any mask arithmetic
  PARTIAL  anything else (or unsure): visited with the per-element mask

The classification is conservative (a PARTIAL tile may turn out empty, a FULL one never
hides a masked pair), written once for NumPy and jax.numpy: the kernel builds its map from the
metadata it receives inside jit (so per-batch documents, padding and every ring step are
covered, with no step index needed), and `visited_tiles` evaluates the very same function in
NumPy on a layout plan's static rows to report how much of the mask a strategy visits.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.kernels.mask import CLEAN, NOISY, NOISY_CAUSAL, RowMeta, row_meta, windowed

EMPTY, PARTIAL, FULL = 0, 1, 2
_BIG = 2**30  # sentinel for "no such row in this tile": larger than any block or document id


class TileSummary(NamedTuple):
  """Per tile of rows, each int [S, n_tiles]: ranges over the tile's non-padding rows.

  An absent stream has lo = _BIG > hi = -_BIG, so every comparison with it is False.
  """

  noisy_lo: np.ndarray
  noisy_hi: np.ndarray
  clean_lo: np.ndarray
  clean_hi: np.ndarray
  seg_lo: np.ndarray
  seg_hi: np.ndarray
  pos_lo: np.ndarray  # positions of the tile's rows as keys
  pos_hi: np.ndarray
  win_lo: np.ndarray  # window starts (RowMeta.lo) of the tile's rows as queries
  win_hi: np.ndarray
  dense: np.ndarray  # bool: no padding row (and no NOISY_CAUSAL query) in the tile


class TileList(NamedTuple):
  """Per row tile, the column tiles to visit: FULL ones first, then PARTIAL ones.

  order:  int32 [S, n_rows, n_cols], column tile indices (entries past the counts unused)
  counts: int32 [S, n_rows, 2], (number of FULL, number of PARTIAL) column tiles
  """

  order: np.ndarray
  counts: np.ndarray


def pad_meta(meta: RowMeta, multiple: int, xp) -> RowMeta:
  """Pads the rows of `meta` [S, R] to a multiple of `multiple` with padding rows (seg 0)."""
  pad = -meta.seg.shape[1] % multiple
  return jax.tree.map(lambda x: xp.pad(x, ((0, 0), (0, pad))), meta)


def summarize(meta: RowMeta, tile: int, xp) -> TileSummary:
  """The TileSummary of `meta` [S, R] cut into tiles of `tile` rows (R padded as needed)."""
  meta = pad_meta(meta, tile, xp)
  s, r = meta.seg.shape
  win = xp.zeros_like(meta.seg) if meta.lo is None else meta.lo  # keys: no window start
  stream, block, seg, pos, win = (x.reshape(s, r // tile, tile) for x in (*meta[:4], win))
  valid = seg > 0
  noisy = valid & (stream != CLEAN)  # NOISY_CAUSAL queries are noisy
  clean = valid & (stream == CLEAN)
  lo = lambda rows, x: xp.where(rows, x, _BIG).min(axis=-1)
  hi = lambda rows, x: xp.where(rows, x, -_BIG).max(axis=-1)
  return TileSummary(lo(noisy, block), hi(noisy, block), lo(clean, block), hi(clean, block),
                     lo(valid, seg), hi(valid, seg), lo(valid, pos), hi(valid, pos),
                     lo(valid, win), hi(valid, win),
                     (valid & (stream != NOISY_CAUSAL)).all(axis=-1))  # causal: never FULL


def classify(q: TileSummary, k: TileSummary, xp) -> np.ndarray:
  """int32 [S, n_q, n_k] of EMPTY / PARTIAL / FULL for every (query tile, key tile) pair."""
  q = TileSummary(*(x[:, :, None] for x in q))
  k = TileSummary(*(x[:, None, :] for x in k))
  has = lambda lo, hi: lo <= hi
  q_noisy, q_clean = has(q.noisy_lo, q.noisy_hi), has(q.clean_lo, q.clean_hi)
  k_noisy, k_clean = has(k.noisy_lo, k.noisy_hi), has(k.clean_lo, k.clean_hi)
  # Some pair may attend (the Section 2 rules applied to ranges; absent streams never match).
  same_doc_possible = (q.seg_lo <= k.seg_hi) & (k.seg_lo <= q.seg_hi)
  noisy_noisy = (q.noisy_lo <= k.noisy_hi) & (k.noisy_lo <= q.noisy_hi)
  noisy_clean = k.clean_lo < q.noisy_hi
  clean_clean = k.clean_lo <= q.clean_hi
  in_window = k.pos_hi >= q.win_lo
  some = same_doc_possible & in_window & (noisy_noisy | noisy_clean | clean_clean)
  # Every pair attends: one document, no padding, and each present stream pairing always allowed.
  one_doc = (q.dense & k.dense & (q.seg_lo == q.seg_hi) & (k.seg_lo == k.seg_hi)
             & (q.seg_lo == k.seg_lo))
  one_block = ((q.noisy_lo == q.noisy_hi) & (k.noisy_lo == k.noisy_hi)
               & (q.noisy_lo == k.noisy_lo))
  every = (one_doc & (k.pos_lo >= q.win_hi)
           & ~(q_noisy & k_noisy & ~one_block)
           & ~(q_noisy & k_clean & ~(k.clean_hi < q.noisy_lo))
           & ~(q_clean & k_noisy)
           & ~(q_clean & k_clean & ~(k.clean_hi <= q.clean_lo)))
  return xp.where(every, FULL, xp.where(some, PARTIAL, EMPTY)).astype(xp.int32)


def tile_kinds(q_meta: RowMeta, k_meta: RowMeta, tile_q: int, tile_k: int, xp) -> np.ndarray:
  """int32 [S, ceil(Rq/tile_q), ceil(Rk/tile_k)]: EMPTY / PARTIAL / FULL per tile pair."""
  return classify(summarize(q_meta, tile_q, xp), summarize(k_meta, tile_k, xp), xp)


def tile_list(kinds):
  """The TileList of `kinds` [S, n_rows, n_cols] (jax.numpy: runs inside jit)."""
  rank = jnp.where(kinds == FULL, 0, jnp.where(kinds == PARTIAL, 1, 2))
  order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.stack([(kinds == FULL).sum(-1), (kinds == PARTIAL).sum(-1)], -1)
  return TileList(order, counts.astype(jnp.int32))


# ---- Static view of a layout plan: what the kernel visits under each strategy --------------

def plan_row_meta(plan) -> RowMeta:
  """NumPy RowMeta [P, rows_per_rank] of a LayoutPlan's rows, one document, padding seg 0."""
  rows = plan.rows
  valid = rows >= 0
  stream = np.where(rows >= plan.noisy_len, CLEAN, NOISY)
  pos = np.where(valid, rows, 0) - np.where(stream == CLEAN, plan.noisy_len, 0)
  return row_meta(stream.astype(np.int32), (pos // plan.block_size).astype(np.int32),
                  valid.astype(np.int32), pos.astype(np.int32))


def kernel_calls(plan, transport: str, window: int | None = None, exchange=None):
  """(q_meta, k_meta) NumPy [1, R] pairs of every attention-kernel call a step makes.

  local: each rank's rows against themselves; ring: each rank's stay part, then at ring
  step s the travelling part of rank (r - s) % P; allgather: stay part + all travel parts;
  exchange (a local layer of window W, `exchange` its parallel.window.ExchangePlan): each
  rank's rows + the rows it receives. With a `window`, the queries carry its window starts.
  """
  meta = plan_row_meta(plan)
  p = plan.num_ranks
  split = plan.n_stay
  rank = lambda r, lo=0, hi=None: RowMeta(*(x[r:r + 1, lo:hi] for x in meta))
  concat = lambda parts: RowMeta(*(np.concatenate(xs, 1) for xs in zip(*parts)))
  for r in range(p):
    q = rank(r) if window is None else windowed(rank(r), window, plan.block_size)
    q = RowMeta(*(np.asarray(x) for x in q))
    if transport == "local":
      yield q, rank(r)
      continue
    stay = [rank(r, 0, split)] if split else []  # an empty stay part makes no kernel call
    if transport == "ring":
      for kv in stay + [rank((r - step) % p, split) for step in range(p)]:
        yield q, kv
    elif transport == "allgather":
      yield q, concat(stay + [rank(src, split) for src in range(p)])
    elif transport == "exchange":
      received = []
      for d, send, valid in zip(exchange.distances, exchange.send, exchange.valid):
        src = (r - d) % p
        rows = RowMeta(*(x[:, split:][:, send[src]] for x in rank(src)))
        received.append(rows._replace(seg=np.where(valid[src], rows.seg, 0)))
      yield q, concat([rank(r)] + received)
    else:
      raise ValueError(f"unknown transport {transport!r}; valid: local, ring, allgather, "
                       f"exchange")


def visited_tiles(plan, transport: str, tile_q: int, tile_k: int, window: int | None = None,
                  exchange=None) -> dict:
  """Tiles the kernel visits for one sequence under `plan` (all ranks, all ring steps), on a
  global layer or (`window`, and `exchange` for that transport) a local one.

  Returns counts of visited / full / total tiles and allowed / total (query, key) pairs, and
  the two fractions a reader compares: `visited_fraction` (of all tiles) and
  `allowed_fraction` (of all pairs). Their gap is the partial tiles' masked-out area. The
  calls meet each key a query may see once, so their allowed pairs are the plan's
  (`LayoutPlan.attention_work`).
  """
  visited = full = total = pairs = 0
  for q_meta, k_meta in kernel_calls(plan, transport, window, exchange):
    kinds = tile_kinds(q_meta, k_meta, tile_q, tile_k, np)
    visited += int((kinds != EMPTY).sum())
    full += int((kinds == FULL).sum())
    total += kinds.size
    pairs += q_meta.seg.size * k_meta.seg.shape[1]
  allowed_pairs = int(plan.attention_work(window).sum())
  return dict(visited=visited, full=full, total=total, allowed_pairs=allowed_pairs,
              pairs=pairs, visited_fraction=visited / total,
              allowed_fraction=allowed_pairs / pairs)
