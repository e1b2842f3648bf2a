"""Query rotation: a drafter's draft queries travel around the ring, the context K/V stay.

Under csbp a rank's draft queries attend to its own draft rows' K/V (which never move) and to
every rank's context K/V. The K/V ring (ring.py) moves the context; when a rank's draft
queries, with their partial softmax state, are fewer bytes than its context K/V shard (a
drafter's few anchors over a long context), moving the queries is cheaper:

  forward   each rank's (Q, metadata) packet visits every other rank (P-1 hops); the rank it
            visits attends it to its local context K/V, and the f32 partial (out, lse) follows
            its packet one hop behind, merged there with the next visit's, until a last hop
            brings it home, where the origin merges it with its own local attention;
  backward  (Q, metadata, O, LSE, dO, dLSE) circulate the same way; each visited rank adds the
            packet's dK/dV into its own context K/V gradients (they never move) and the dQ
            partial follows the packet home, in `grad_dtype`.

A packet's hop comes before its visit; its partial's hop overlaps the visit. Each rank holds
one visiting packet and one partial at a time: memory stays O(L/P). The seed (Turbo-dLLM 0.1.6,
attention/dflash_attention.py ~555-829) keeps one state per origin and reduces them after the
ring; the bytes are the same (`query_hop_bytes`).
"""

import functools

import jax
import jax.numpy as jnp

from bdlm_jax.config import Config
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.kernels.xla import merge
from bdlm_jax.models.drafter import drafter_model
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.prune import context_rows
from bdlm_jax.parallel.ring import partial_attend, partial_grads, shift

# The int32 metadata fields a row sends: a key's lack its window start (`mask.as_keys`), a
# travelling query's its position (`_travelling`).
META_ROW_BYTES = (len(RowMeta._fields) - 1) * 4


def query_hop_bytes(q_elems: float, stat_elems: float, itemsize: int, grad_itemsize: int,
                    meta_bytes: float, forwards: int = 1) -> float:
  """Bytes the query transport sends per ring hop for `q_elems` query elements and
  `stat_elems` softmax statistics (one per query row and head): forward Q + metadata and the
  f32 (out, lse) partial; backward Q, O, dO + metadata, f32 LSE and dLSE, and the dQ partial.
  `forwards`: forward passes per step (2 where remat re-runs the forward in the backward).
  With dQ in f32, the seed's 4qs + 8q + 12 stat + 2 meta (dflash_attention.py ~167-172)."""
  forward = q_elems * itemsize + meta_bytes + 4 * (q_elems + stat_elems)
  backward = 3 * q_elems * itemsize + meta_bytes + 8 * stat_elems + q_elems * grad_itemsize
  return forwards * forward + backward


def kv_hop_bytes(kv_elems: float, itemsize: int, grad_itemsize: int, meta_bytes: float,
                 forwards: int = 1) -> float:
  """Bytes the K/V ring sends per hop for `kv_elems` K and V elements: K/V + metadata forward
  and again backward, and the dK/dV accumulators. With dK/dV in the compute dtype this is the
  seed's 6 kv s (kv: K elements alone; dflash_attention.py ~166)."""
  return (forwards + 1) * (kv_elems * itemsize + meta_bytes) + kv_elems * grad_itemsize


def prefers_query_rotation(num_ranks: int, query_bytes: float, kv_bytes: float) -> bool:
  """Our rule (`parallel.draft_transport=auto`): rotate the queries where they send fewer bytes
  per hop than the context K/V actually sent (`transport_bytes`: the pruned rows, metadata and
  dK/dV in kv_grad_dtype included), on a ring of more than two ranks (at two, the extra round
  of the partials' hop makes it latency-bound). No memory test: one travelling state at a
  time (the module docstring) holds less than the K/V ring's. The seed's rule differs:
  `seed_prefers_query_rotation`."""
  return num_ranks > 2 and query_bytes < kv_bytes


# The seed's per-anchor metadata (DFlashGlobalContextMask, core/attention/masks.py ~247-271):
# int32 context_starts and context_stops and a bool anchor_valid.
SEED_META_ANCHOR_BYTES = 4 + 4 + 1


def _drafter_sizes(cfg: Config):
  """(query heads, K/V heads, head_dim, compute bytes, dK/dV bytes) of `cfg`'s drafter."""
  d = drafter_model(cfg)
  return (d.n_heads, d.n_kv_heads, d.head_dim, jnp.dtype(d.compute_dtype).itemsize,
          jnp.dtype(cfg.parallel.kv_grad_dtype).itemsize)


def _seed_terms(cfg: Config, plan: LayoutPlan):
  """(q, stat, kv, meta, s) as the seed counts them (dflash_attention.py ~148-172): the draft
  rows' query elements and softmax statistics, the K elements of the *unpruned* context slot,
  9 B of metadata an anchor (`SEED_META_ANCHOR_BYTES`), the compute dtype's bytes."""
  h, h_kv, dh, s, _ = _drafter_sizes(cfg)
  q, stat = plan.n_noisy * h * dh, plan.n_noisy * h
  kv = (plan.rows_per_rank - plan.n_noisy) * h_kv * dh
  return q, stat, kv, SEED_META_ANCHOR_BYTES * plan.n_noisy // plan.block_size, s


def transport_bytes(cfg: Config, plan: LayoutPlan, rule: str = "auto") -> dict[str, float]:
  """{"query": bytes, "kv": bytes}: what one hop of one drafter layer sends for each sequence
  a rank holds (forward and backward, one forward pass) under each draft transport, as
  `rule` counts them: "auto" (ours) its real bytes, `query_hop_bytes` of the rank's draft
  rows and `kv_hop_bytes` of the context rows it keeps (`prune.context_rows`, metadata and
  dK/dV in kv_grad_dtype); "seed" (dflash_attention.py ~148-172) Q 4qs + 8q + 12 stat +
  2 meta against K/V 6 kv s (terms: `_seed_terms`)."""
  if rule == "seed":
    q, stat, kv, meta, s = _seed_terms(cfg, plan)
    return {"query": 4 * q * s + 8 * q + 12 * stat + 2 * meta, "kv": 6 * kv * s}
  if rule != "auto":
    raise ValueError(f"rule={rule!r} is not 'auto' or 'seed'")
  h, h_kv, dh, s, g = _drafter_sizes(cfg)
  return {"query": plan.n_noisy * query_hop_bytes(h * dh, h, s, g, META_ROW_BYTES),
          "kv": context_rows(cfg, plan) * kv_hop_bytes(2 * h_kv * dh, s, g, META_ROW_BYTES)}


def seed_peaks(cfg: Config, plan: LayoutPlan) -> dict[str, float]:
  """The seed's memory test (dflash_attention.py ~174-189), bytes per sequence: "query" the
  query path's peak, max of forward (P+1)(4q + 8 stat) + 2(q s + meta) (an f32 state per
  origin, two packets) and backward (P+1) 4q + 8 kv + 2(3 q s + 4 stat + meta) (an f32 dQ
  per origin, f32 dK/dV, two packets); "kv" the K/V ring's backward peak 12 kv s (terms as
  `transport_bytes(rule="seed")`)."""
  p = plan.num_ranks
  q, stat, kv, meta, s = _seed_terms(cfg, plan)
  forward = (p + 1) * (4 * q + 8 * stat) + 2 * (q * s + meta)
  backward = (p + 1) * 4 * q + 8 * kv + 2 * (3 * q * s + 4 * stat + meta)
  return {"query": max(forward, backward), "kv": 12 * kv * s}


def seed_prefers_query_rotation(cfg: Config, plan: LayoutPlan) -> bool:
  """The seed's rule (`parallel.draft_transport=seed`; dflash_attention.py ~86-104 and
  `_prefer_query_rotation` ~125-189): rotate the queries where only the context travels
  (`plan.travel == "clean"`), on a ring of more than one rank, the anchors split equally
  (each rank all of them where every rank holds every draft block, the seed's `all_blocks`,
  our cp_replicated_drafts; else A / P each, its `dual_end`, our csbp), the seed's query
  bytes under its K/V bytes (`transport_bytes(rule="seed")`) and the query path's peak under
  the K/V ring's (`seed_peaks`); but never on a `dual_end` ring of two or fewer ranks."""
  p, a = plan.num_ranks, plan.draft_blocks
  if plan.travel != "clean" or p <= 1 or a <= 0:
    return False
  drafts = plan.rows[:, :plan.n_noisy]
  dual_end = not (drafts == drafts[:1]).all()  # the ranks hold different draft blocks
  owners = p if dual_end else 1
  if a % owners or plan.n_noisy != a // owners * plan.block_size:
    return False
  if dual_end and p <= 2:
    return False
  sent, peak = transport_bytes(cfg, plan, "seed"), seed_peaks(cfg, plan)
  return sent["query"] < sent["kv"] and peak["query"] < peak["kv"]


def _travelling(meta: RowMeta) -> RowMeta:
  """A query's metadata as it travels: without its position, which its mask never reads
  (`mask.allowed` reads a query's stream, block, segment and window start)."""
  return meta._replace(pos=None)


def _arrived(meta: RowMeta) -> RowMeta:
  """A visiting query's metadata, its position filled with any array of that shape (a
  kernel's tile summary takes one; `_travelling`)."""
  return meta._replace(pos=meta.seg)


def _rotate(axis: str, num_ranks: int, packet, visit):
  """Sends every rank's `packet` past every other rank; `visit(packet, partial=None) ->
  (partial, stays)` runs at each, the packet's partial following it one hop behind and
  `stays` summed where computed. Returns (the local packet's partial, home by a last hop;
  the visitors' summed `stays`)."""
  hop = functools.partial(shift, axis=axis, num_ranks=num_ranks)
  here = hop(packet)
  part, stays = visit(here)

  def step(carry, _):
    here, part, stays = carry
    here, part = hop(here), hop(part)
    part, stay = visit(here, part)
    return (here, part, jax.tree.map(jnp.add, stays, stay)), None

  (_, part, stays), _ = jax.lax.scan(step, (here, part, stays), length=num_ranks - 2)
  return hop(part), stays


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def query_ring_attend(kernel, axis, num_ranks, chunk, grad_dtype, q, k_own, v_own, k_ctx, v_ctx,
                      q_meta, own_meta, ctx_meta):
  """(out, lse) of local queries against the local `own` K/V (their draft rows) and every
  rank's context K/V, the queries travelling (ring.py's `ring_attend` with roles swapped)."""
  return _fwd(kernel, axis, num_ranks, chunk, grad_dtype, q, k_own, v_own, k_ctx, v_ctx,
              q_meta, own_meta, ctx_meta)[0]


def _fwd(kernel, axis, num_ranks, chunk, grad_dtype, q, k_own, v_own, k_ctx, v_ctx, q_meta,
         own_meta, ctx_meta):
  def visit(packet, part=None):  # merged into the packet's running part as it is computed
    return partial_attend(kernel, chunk, packet[0], k_ctx, v_ctx, _arrived(packet[1]),
                          ctx_meta, into=part), ()

  home = partial_attend(kernel, chunk, q, k_ctx, v_ctx, q_meta, ctx_meta,
                        into=partial_attend(kernel, chunk, q, k_own, v_own, q_meta, own_meta))
  away, _ = _rotate(axis, num_ranks, (q, _travelling(q_meta)), visit)
  out, lse = merge(*home, *away)
  out, lse = residuals.keep(out.astype(q.dtype), lse)
  return (out, lse), (q, k_own, v_own, k_ctx, v_ctx, q_meta, own_meta, ctx_meta, out, lse)


def _bwd(kernel, axis, num_ranks, chunk, grad_dtype, res, cts):
  q, k_own, v_own, k_ctx, v_ctx, q_meta, own_meta, ctx_meta, out, lse = res
  dout, dlse = cts
  grads = functools.partial(partial_grads, kernel, chunk)

  def visit(packet, dq=None):
    q_i, meta_i, out_i, lse_i, dout_i, dlse_i = packet
    dq, dk, dv = grads(q_i, k_ctx, v_ctx, _arrived(meta_i), ctx_meta, out_i, lse_i, dout_i,
                       dlse_i, dq)
    return dq.astype(grad_dtype), (dk, dv)

  dq, dk_own, dv_own = grads(q, k_own, v_own, q_meta, own_meta, out, lse, dout, dlse)
  dq, dk_ctx, dv_ctx = grads(q, k_ctx, v_ctx, q_meta, ctx_meta, out, lse, dout, dlse, dq)
  packet = (q, _travelling(q_meta), out, lse, dout, dlse)
  dq_away, (dk_away, dv_away) = _rotate(axis, num_ranks, packet, visit)
  return ((dq + dq_away).astype(q.dtype), dk_own.astype(k_own.dtype),
          dv_own.astype(v_own.dtype), (dk_ctx + dk_away).astype(k_ctx.dtype),
          (dv_ctx + dv_away).astype(v_ctx.dtype), None, None, None)


query_ring_attend.defvjp(_fwd, _bwd)
