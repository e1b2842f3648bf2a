"""The attention of a strategy: its static layout plan's rows, moved by its transport over
the `seq` mesh axis (the strategy records live in registry.py).

Only attention needs `shard_map`; embeddings, norms, MLPs and the loss run as ordinary jit
code on row-sharded arrays. The transport decides how the plan's travelling K/V reach the
other ranks: a `ppermute` ring (ring.py) or one all-gather (allgather.py); both take the
same arguments and return the travelling K/V gradients to their owners. Local
(sliding-window) layers use the windowed exchange (window.py) instead, which moves only the
rows their windows reach, wherever that is less than the global transport moves. A drafter's
draft attention may instead keep the context K/V still and rotate its draft queries
(query_ring.py), where that sends fewer bytes (`draft_transport`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import get_kernel, with_windows
from bdlm_jax.kernels.mask import RowMeta, as_keys
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel import query_ring
from bdlm_jax.parallel.allgather import allgather_attend
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.prune import make_prune
from bdlm_jax.parallel.mesh import BATCH_AXES
from bdlm_jax.parallel.recurrence import make_recur
from bdlm_jax.parallel.registry import get_strategy, plan_for
from bdlm_jax.parallel.ring import ring_attend
from bdlm_jax.parallel.window import exchange_attend, exchange_plan

# The name scope of the attention `shard_map`: HLO collectives whose op_name holds it (forward
# and backward) are the attention's traffic; the rest of a step's are weight traffic.
ATTENTION_SCOPE = "seq_attention"


def _local_attend(split: int, transport: str, kernel, chunk: int, num_ranks: int,
                  grad_dtype):
  """Attention over one rank's rows, whose K/V from row `split` on travel (under `query`, the
  queries travel past them instead); runs inside shard_map (or alone on one device)."""
  attend = functools.partial(kernel.attend, chunk=chunk)
  if transport == "local":
    return attend
  if transport == "ring":
    move = functools.partial(ring_attend, kernel, "seq", num_ranks, chunk, grad_dtype)
  elif transport == "query":
    move = functools.partial(query_ring.query_ring_attend, kernel, "seq", num_ranks, chunk,
                             grad_dtype)
  else:
    move = functools.partial(allgather_attend, kernel, "seq", chunk, grad_dtype)

  def body(q, k, v, q_meta: RowMeta, k_meta: RowMeta):
    k_meta = as_keys(k_meta)
    return move(q, k[:, :split], v[:, :split], k[:, split:], v[:, split:], q_meta,
                k_meta.slice_rows(0, split), k_meta.slice_rows(split, k.shape[1]))

  return body


@functools.lru_cache(maxsize=64)
def exchange_for(plan: LayoutPlan, window: int):
  """The windowed exchange of `plan`'s local layers of window W (cached: plans are static)."""
  return exchange_plan(plan, window)


def window_transport(plan: LayoutPlan, window: int) -> str:
  """How a local layer of window W moves K/V under `plan`: `exchange` when the windowed
  exchange sends fewer rows than the strategy's global transport, else that transport."""
  transport = get_strategy(plan.strategy).transport
  if transport == "local":
    return transport
  travelling = (plan.rows_per_rank - plan.n_stay) * (plan.num_ranks - 1)
  return "exchange" if exchange_for(plan, window).rows_sent() < travelling else transport


def _windowed_attend(plan: LayoutPlan, global_body, kernel, chunk: int, window: int,
                     block_unit: int):
  """The attention body of a local layer of window W (`block_unit`: positions per unit of a
  row's `block`, see `windowed`)."""
  if window_transport(plan, window) == "exchange":
    return functools.partial(exchange_attend, kernel, "seq", exchange_for(plan, window),
                             plan.n_stay, chunk, window, block_unit)

  return functools.partial(with_windows(global_body, block_unit), window=window)


def make_attend(cfg: Config, mesh=None, rows: str = "all", plan: LayoutPlan | None = None):
  """`attend(q, k, v, q_meta, k_meta, window=None) -> (out, lse)` over layout-ordered,
  row-sharded arrays; `window` W makes it a local layer's sliding-window attention.

  `rows` names the rows of each rank that take part: "all" of them, or a drafter's (dflash)
  "clean" slot, where its frozen target runs causally over the context (the context travels
  where the strategy moves anything), or "draft", see `_draft_attend`. `plan` is
  `plan_for(cfg)`, given where the caller resolved it already.
  """
  if rows not in ("all", "clean", "draft"):
    raise ValueError(f"rows={rows!r} is not 'all', 'clean' or 'draft'")
  plan = plan_for(cfg) if plan is None else plan
  kernel = get_kernel(cfg.model.attention_impl)
  transport = get_strategy(plan.strategy).transport
  if rows == "clean" and plan.travel == "none":
    transport = "local"  # bp replicates the context on every rank
  if rows == "draft" and draft_transport(cfg, plan) == "query":
    transport = "query"  # the draft queries travel, the context stays
  split = 0 if rows == "clean" else plan.n_stay
  chunk = cfg.model.attention_chunk
  global_body = _local_attend(split, transport, kernel, chunk, plan.num_ranks,
                              jnp.dtype(cfg.parallel.kv_grad_dtype))
  if mesh is None and plan.num_ranks != 1:
    raise ConfigError(f"strategy {cfg.parallel.strategy!r} with parallel.seq="
                      f"{cfg.parallel.seq} needs a mesh: pass mesh=make_mesh(cfg)")
  if rows == "draft":
    return _draft_attend(cfg, mesh, global_body, make_prune(cfg, plan, mesh))
  bodies = {None: _sharded(cfg, mesh, global_body, n_kv=1)}
  block_unit = plan.block_size if get_objective(cfg.objective.name).BLOCK_IDS == "index" else 1

  def attend(q, k, v, q_meta, k_meta, window=None):
    if window is not None and rows != "all":  # the windowed exchange plans whole layouts
      raise ValueError(f"local layers over {rows!r} rows are not supported")
    if window not in bodies:
      bodies[window] = _sharded(cfg, mesh, _windowed_attend(plan, global_body, kernel, chunk,
                                                            window, block_unit), n_kv=1)
    with jax.named_scope(ATTENTION_SCOPE):
      return bodies[window](q, k, v, q_meta, k_meta)

  attend.recur = make_recur(plan, mesh)  # Gated DeltaNet layers' streams (parallel/recurrence.py)
  return attend


def _sharded(cfg: Config, mesh, body, n_kv: int):
  """`body` run per device over `mesh`'s row shards: queries, then `n_kv` groups of
  (k, v, meta) rows after the queries' (q, k, v, q_meta, k_meta)."""
  if mesh is None:
    return body
  rows = P(BATCH_AXES, "seq")
  heads = P(BATCH_AXES, "seq", None, None)
  meta = RowMeta(*[rows] * len(RowMeta._fields))
  extra = (heads, heads, meta) * (n_kv - 1)
  # pallas_call outputs carry no varying-axes type, so shard_map cannot check them.
  return jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, meta, meta, *extra),
                       out_specs=(heads, P(BATCH_AXES, "seq", None)),
                       check_vma=cfg.model.attention_impl == "xla")


def draft_transport(cfg: Config, plan: LayoutPlan) -> str:
  """What a drafter's draft attention moves under `plan`: "query" (its draft queries rotate
  past the context, query_ring.py) or "kv" (the strategy's own transport: the context K/V,
  or everything under cp, or nothing). `parallel.draft_transport`: "kv" or "query" as named
  (where only the context travels); "auto" our rule, the fewer bytes a hop actually sent
  (`query_ring.prefers_query_rotation`); "seed" the seed's rule
  (`query_ring.seed_prefers_query_rotation`). Static: the config and the plan alone."""
  choice = cfg.parallel.draft_transport
  if plan.travel != "clean" or choice == "kv":
    return "kv"
  if choice == "query":
    return choice
  if choice == "seed":
    return "query" if query_ring.seed_prefers_query_rotation(cfg, plan) else "kv"
  sent = query_ring.transport_bytes(cfg, plan)
  rotate = query_ring.prefers_query_rotation(plan.num_ranks, sent["query"], sent["kv"])
  return "query" if rotate else "kv"


def _draft_attend(cfg: Config, mesh, global_body, prune):
  """`attend(q, k, v, q_meta, k_meta, k_ctx, v_ctx, ctx_meta) -> (out, lse)` of a drafter's
  layer: queries are each rank's draft rows (its noisy slot), keys its draft rows and the
  context rows (its clean slot) given apart, as the drafter computes them. Each rank joins
  them into its layout's rows, so the strategy's transport moves what it always moves:
  nothing (none, bp), the context (csbp), or both (cp); or, where `draft_transport` says
  "query", the draft queries move past a context that stays. `attend.prune` cuts the context
  rows down to those the draft windows reach before the drafter projects them (`prune`,
  parallel/prune.py; None where it keeps them all)."""
  def body(q, k, v, q_meta, k_meta, k_ctx, v_ctx, ctx_meta):
    join = lambda a, b: jnp.concatenate([a, b], axis=1)
    return global_body(q, join(k, k_ctx), join(v, v_ctx), q_meta, k_meta.concat(ctx_meta))

  sharded = _sharded(cfg, mesh, body, n_kv=2)

  def attend(*args):
    with jax.named_scope(ATTENTION_SCOPE):
      return sharded(*args)

  attend.prune = prune
  return attend
