"""Context pruning: each rank keeps only the context rows some draft query can see.

A drafter's context rows are keys only, and everything done to one (`fc`, the norm, RoPE, the
k/v projections) is row-wise; a row that no draft query's window reaches has no influence on
the loss and gets no gradient. Slot j of anchor a sees positions [a + j - W + 1, a) of its own
document, so the rows that matter are the union over anchors of [max(d, a - W + 1), a), d the
start of a's document (every position of it before a on a drafter without a window). The seed
(Turbo-dLLM 0.1.6, `model.py` `compact_dflash_target_context` ~1098-1213) cuts each rank's
shard down to that union before `fc`; so does this. Every transport then moves, and every
layer projects, those rows only.

The union is the batch's, so the host finds it (`kept_rows`, in `make_batch`): each rank's
kept rows as indices into its context slot, in position order, padded to one width for the
batch (`Batch.kept`). The step reads the width from the batch: `drafter.kept_context_rows`,
the size `mode=plan` compiles, or, for a batch whose windows reach more, the first of its
doublings that holds them (`capacity`). Such a batch compiles the step once more for its
size, where the seed pads each step's packets to its own largest owner: no batch is refused
and no row that matters is dropped.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.mesh import BATCH_AXES

_NO_ANCHOR = 2**30  # sorts after every position: "no anchor after this row"


def reached(anchors, anchor_docs, pos, docs, window: int):
  """bool [C]: which positions `pos` [C] of documents `docs` [C] some anchor's draft window
  reaches, given the anchors [A] sorted ascending (absent ones `_NO_ANCHOR`) and their
  documents: the first anchor after p is in p's document and within W - 1 of it (W = 0:
  in p's document). Documents are runs of positions, so an anchor of p's document after p
  comes before any of a later one."""
  at = np.searchsorted(anchors, pos, side="right")
  first = np.minimum(at, anchors.shape[0] - 1)
  after = anchors[first]
  found = (at < anchors.shape[0]) & (after < _NO_ANCHOR) & (anchor_docs[first] == docs)
  return found & (after - pos < window) if window else found


def sorted_anchors(block, seg):
  """([A*B] sorted anchors, [A*B] their documents) of draft rows' `block` (a draft row's
  block is its anchor) and `seg` (padding rows have none), duplicates kept."""
  anchors = np.where(seg > 0, block, _NO_ANCHOR)
  order = np.argsort(anchors, kind="stable")
  return anchors[order], seg[order]


def context_rows(cfg: Config, plan: LayoutPlan) -> int:
  """Context rows a rank's drafter layers see in the compiled step `mode=plan` reports:
  `drafter.kept_context_rows` where it prunes the rank's clean slot, else the whole slot."""
  whole = plan.rows_per_rank - plan.n_noisy
  cap = cfg.drafter.kept_context_rows
  return min(cap, whole) if cap else whole


def capacity(cfg: Config, plan: LayoutPlan, need: int) -> int:
  """Context rows a rank keeps for a batch whose windows reach `need` of some rank's:
  `context_rows`, doubled until it holds them (a few sizes, each compiled once), at most the
  whole slot."""
  cap, whole = context_rows(cfg, plan), plan.rows_per_rank - plan.n_noisy
  while cap < need:
    cap = min(2 * cap, whole)
  return cap


def pruned_rows(cfg: Config, plan: LayoutPlan) -> int:
  """Context rows each rank drops (0: pruning is off, or keeps the whole slot)."""
  return plan.rows_per_rank - plan.n_noisy - context_rows(cfg, plan)


def sees_every_anchor(plan: LayoutPlan) -> bool:
  """Whether a rank's context rows serve every rank's draft queries (they travel, or the
  queries do), not only its own (`bp` replicates the context: each rank prunes its copy to
  its own anchors' windows)."""
  return plan.travel != "none"


def kept_rows(cfg: Config, plan: LayoutPlan, rows: dict) -> np.ndarray | None:
  """int32 [S, P * cap]: for each rank, the indices into its context slot of the rows some
  anchor's window reaches (`rows`: layout-ordered [S, P*R] fields), in position order, -1
  after them; cap = `capacity` of the batch's largest rank. None where nothing is pruned."""
  if not pruned_rows(cfg, plan):
    return None
  n, every = plan.n_noisy, sees_every_anchor(plan)
  seg, pos, block = (np.asarray(rows[k]).reshape(-1, plan.num_ranks, plan.rows_per_rank)
                     for k in ("seg", "pos", "block"))
  keep = np.zeros((seg.shape[0], plan.num_ranks, plan.rows_per_rank - n), bool)
  for s, r in np.ndindex(keep.shape[:2]):
    sees = slice(None) if every else slice(r, r + 1)  # whose anchors reach rank r's rows
    anchors = sorted_anchors(block[s, sees, :n].ravel(), seg[s, sees, :n].ravel())
    keep[s, r] = reached(*anchors, pos[s, r, n:], seg[s, r, n:], cfg.drafter.window) & (
        seg[s, r, n:] > 0)
  out = np.full((*keep.shape[:2], capacity(cfg, plan, keep.sum(-1).max())), -1, np.int32)
  for s, r in np.ndindex(keep.shape[:2]):
    at = np.flatnonzero(keep[s, r])
    out[s, r, :at.size] = at
  return out.reshape(out.shape[0], -1)


def widen(kept: np.ndarray, plan: LayoutPlan, cap: int) -> np.ndarray:
  """`kept_rows`' [S, P * c] padded to [S, P * cap] (cap >= c): processes that built their
  sequences' batches apart agree on one width."""
  s = kept.shape[0]
  by_rank = kept.reshape(s, plan.num_ranks, -1)
  return np.pad(by_rank, ((0, 0), (0, 0), (0, cap - by_rank.shape[-1])),
                constant_values=-1).reshape(s, -1)


def make_prune(cfg: Config, plan: LayoutPlan, mesh):
  """`prune(kept, ctx_meta, feats, skip) -> (ctx_meta, feats)`: each rank's context rows cut
  to those `kept` names (`Batch.kept`, `kept_rows`); None where nothing is pruned. A rank's
  `feats` rows are `skip` rows, then its context rows: the batch's features
  (`Batch.context`) enter whole, and the kept rows are read from them in place, never
  through a sliced copy of the context. Nothing travels: the host chose the rows."""
  if not pruned_rows(cfg, plan):
    return None

  def body(kept, ctx_meta: RowMeta, feats, skip):
    idx = jnp.maximum(kept, 0)
    take = lambda x, at: jnp.take_along_axis(x, at.reshape(*at.shape, *[1] * (x.ndim - 2)), 1)
    meta = jax.tree.map(lambda x: take(x, idx), ctx_meta)
    return meta._replace(seg=jnp.where(kept < 0, 0, meta.seg)), take(feats, idx + skip)

  def prune(kept, ctx_meta: RowMeta, feats, skip: int = 0):
    if kept is None:
      raise ConfigError("drafter.kept_context_rows prunes the context, and this batch names "
                        "no kept rows (Batch.kept): build it with make_batch for this config")
    args = (kept, ctx_meta, feats)
    if mesh is None:
      return body(*args, skip)
    rows = lambda x: P(BATCH_AXES, "seq", *[None] * (x.ndim - 2))
    specs = jax.tree.map(rows, args)
    return jax.shard_map(functools.partial(body, skip=skip), mesh=mesh, in_specs=specs,
                         out_specs=specs[1:])(*args)

  return prune
