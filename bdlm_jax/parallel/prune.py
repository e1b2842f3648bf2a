"""Context pruning: each rank keeps only the context rows some draft query can see.

A drafter's context rows are keys only, and everything done to one (`fc`, the norm, RoPE, the
k/v projections) is row-wise; a row that no draft query's window reaches has no influence on
the loss and gets no gradient. Slot j of anchor a sees positions [a + j - W + 1, a) of its own
document, so the rows that matter are the union over anchors of [max(d, a - W + 1), a), d the
start of a's document (every position of it before a on a drafter without a window). The seed
(Turbo-dLLM 0.1.6, `model.py` `compact_dflash_target_context` ~1098-1213) cuts each rank's
shard down to that union before
`fc`; so does this, into a static `drafter.kept_context_rows` rows a rank, in position
order, the rest padding (document 0: never seen). Every transport then moves, and every layer
projects, those rows only.

The capacity is static and the union is the batch's: `make_batch` refuses a batch that needs
more (`check_capacity`), so no row that matters is ever dropped.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import CLEAN, NOISY, RowMeta
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.mesh import BATCH_AXES

_NO_ANCHOR = 2**30  # sorts after every position: "no anchor after this row"


def reached(anchors, anchor_docs, pos, docs, window: int, xp=jnp):
  """bool [C]: which positions `pos` [C] of documents `docs` [C] some anchor's draft window
  reaches, given the anchors [A] sorted ascending (absent ones `_NO_ANCHOR`) and their
  documents: the first anchor after p is in p's document and within W - 1 of it (W = 0:
  in p's document). Documents are runs of positions, so an anchor of p's document after p
  comes before any of a later one. One rule for the host's check (NumPy) and the step."""
  at = xp.searchsorted(anchors, pos, side="right")
  first = xp.minimum(at, anchors.shape[0] - 1)
  after = anchors[first]
  found = (at < anchors.shape[0]) & (after < _NO_ANCHOR) & (anchor_docs[first] == docs)
  return found & (after - pos < window) if window else found


def sorted_anchors(block, seg, xp=jnp):
  """([A*B] sorted anchors, [A*B] their documents) of draft rows' `block` (a draft row's
  block is its anchor) and `seg` (padding rows have none), duplicates kept."""
  anchors = xp.where(seg > 0, block, _NO_ANCHOR)
  order = xp.argsort(anchors)
  return anchors[order], seg[order]


def context_rows(cfg: Config, plan: LayoutPlan) -> int:
  """Context rows a rank's drafter layers see: `drafter.kept_context_rows` where it prunes
  the rank's clean slot, else the whole slot."""
  whole = plan.rows_per_rank - plan.n_noisy
  cap = cfg.drafter.kept_context_rows
  return min(cap, whole) if cap else whole


def pruned_rows(cfg: Config, plan: LayoutPlan) -> int:
  """Context rows each rank drops (0: pruning is off, or keeps the whole slot)."""
  return plan.rows_per_rank - plan.n_noisy - context_rows(cfg, plan)


def sees_every_anchor(plan: LayoutPlan) -> bool:
  """Whether a rank's context rows serve every rank's draft queries (they travel, or the
  queries do), not only its own (`bp` replicates the context: each rank prunes its copy to
  its own anchors' windows)."""
  return plan.travel != "none"


def check_capacity(cfg: Config, plan: LayoutPlan, rows: dict) -> None:
  """Refuse a batch (`rows`: layout-ordered [S, P*R] fields) whose anchors' windows reach more
  of a rank's context rows than `drafter.kept_context_rows` keeps."""
  if not pruned_rows(cfg, plan):
    return
  cap, every = context_rows(cfg, plan), sees_every_anchor(plan)
  stream, seg, pos, block = (np.asarray(rows[k]).reshape(-1, plan.num_ranks,
                                                          plan.rows_per_rank)
                             for k in ("stream", "seg", "pos", "block"))
  draft, context = stream == NOISY, (stream == CLEAN) & (seg > 0)
  need = np.zeros(stream.shape[:2], np.int64)
  for s, r in np.ndindex(need.shape):
    sees = slice(None) if every else r  # whose anchors reach rank r's rows
    anchors = sorted_anchors(block[s, sees][draft[s, sees]], seg[s, sees][draft[s, sees]], np)
    need[s, r] = (reached(*anchors, pos[s, r], seg[s, r], cfg.drafter.window, np)
                  & context[s, r]).sum()
  if need.max() > cap:
    s, r = np.unravel_index(need.argmax(), need.shape)
    raise ConfigError(f"drafter.kept_context_rows={cap} is too few for this batch: on rank {r} "
                      f"sequence {s} the anchors' windows reach {need.max()} context rows; "
                      f"raise it to at least {need.max()} (docs/dflash.md, context pruning)")


def make_prune(cfg: Config, plan: LayoutPlan, mesh):
  """`prune(draft_meta, ctx_meta, feats, skip) -> (ctx_meta, feats)`: each rank's context
  rows cut to its `context_rows`; None where nothing is pruned. A rank's `feats` rows are
  `skip` rows, then its context rows: the batch's features (`Batch.context`) enter whole, and
  the kept rows are read from them in place, never through a sliced copy of the context.
  Where its rows serve every rank's queries, a rank reads every rank's anchors (one
  all-gather of its draft rows' anchors and documents, int32)."""
  if not pruned_rows(cfg, plan):
    return None
  cap = context_rows(cfg, plan)
  window, gather = cfg.drafter.window, plan.num_ranks > 1 and sees_every_anchor(plan)

  def body(block, seg, ctx_meta: RowMeta, feats, skip):
    if gather:
      block, seg = (jax.lax.all_gather(x, "seq", axis=1, tiled=True) for x in (block, seg))
    keep = jax.vmap(lambda b, s, p, d: reached(*sorted_anchors(b, s), p, d, window))(
        block, seg, ctx_meta.pos, ctx_meta.seg) & (ctx_meta.seg > 0)
    idx = jax.vmap(lambda k: jnp.nonzero(k, size=cap, fill_value=0)[0])(keep)
    take = lambda x, at: jnp.take_along_axis(x, at.reshape(*at.shape, *[1] * (x.ndim - 2)), 1)
    padding = jnp.arange(cap) >= keep.sum(-1, keepdims=True)
    meta = jax.tree.map(lambda x: take(x, idx), ctx_meta)
    return meta._replace(seg=jnp.where(padding, 0, meta.seg)), take(feats, idx + skip)

  def prune(draft_meta: RowMeta, ctx_meta: RowMeta, feats, skip: int = 0):
    args = (draft_meta.block, draft_meta.seg, ctx_meta, feats)
    if mesh is None:
      return body(*args, skip)
    rows = lambda x: P(BATCH_AXES, "seq", *[None] * (x.ndim - 2))
    specs = jax.tree.map(rows, args)
    return jax.shard_map(functools.partial(body, skip=skip), mesh=mesh, in_specs=specs,
                         out_specs=specs[2:])(*args)

  return prune
