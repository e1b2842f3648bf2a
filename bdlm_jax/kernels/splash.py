"""The `splash` attention: jax's Splash attention kernels (TPU) under the BDLM masks.

Same interface and semantics as kernels/xla.py (the oracle): `attend_fwd` -> (out f32, lse),
`attend_bwd(..., out, lse, dout, dlse, chunk, dq)` -> (dq, dk, dv) f32 given the *global* out
and lse, and the differentiable `attend`. `chunk` is the oracle's and is not used here.

Splash (jax.experimental.pallas.ops.tpu.splash_attention) masks a tile with what it is given
per row: a `mask_function(q_value, k_index)` of one int32 per query and the key's index, and
segment ids compared for equality. A BDLM mask is rewritten into those, per call, with no
Rq x Rk array (docs/kernels.md, "Splash"):

* The keys are sorted by (stream: clean, then noisy, then padding; block; document for noisy
  rows; position). A clean row's block never decreases with its position (pos // B or pos,
  in every objective), so the clean keys a query may see are the index interval
  [first at or after its window start, first of its own block or later) of one document;
  a noisy query's own-block keys are the interval of (noisy, its block, its document),
  cut at its own position for a causal draft slot (`NOISY_CAUSAL`).
* Two Splash calls per sorted key chunk, each one interval per query: against the clean keys
  (documents by segment ids) and against the noisy ones; their (out, lse) merge like a
  ring's parts. The interval's ends are packed into the query's int32 (16 bits each), so a
  call takes at most `MAX_KEYS` keys: longer key sets run in chunks of that many.
* Which (query tile, key tile) pairs the kernel visits comes from the row metadata
  (kernels/tiles.py, the same map the `pallas` kernel walks), computed in the program: every
  ring step, gathered shard and document layout gets its own, with no step index.

Splash does not scale q: q is scaled before the call and dq after. Its forward casts out to
q's dtype per call (a bf16 step merges bf16-rounded parts, within flash tolerance; f32 is
exact). On TPU the kernels compile through Mosaic; elsewhere they run in interpret mode
(`lax.platform_dependent` picks per lowering, so a CPU host compiles a TPU step for real).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as smi

from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import CLEAN, NOISY_CAUSAL, RowMeta
from bdlm_jax.kernels.tiles import EMPTY, tile_kinds
from bdlm_jax.kernels.xla import NEG_INF, merge

LANES = 128  # Splash tiles are multiples of the TPU's 128 lanes
TILE = 512  # rows per query and key tile where a call has that many
MAX_KEYS = 1 << 15  # keys per call: an interval end packs into 16 bits beside the other
_BIG = 2**30
_HALF = 16
_LOW = (1 << _HALF) - 1


class SortedKeys(NamedTuple):
  """One sequence's keys in splash order: `order` [Rk] (sorted index -> row), and the sort
  keys' columns gathered in that order, each int32 [Rk]."""

  order: jnp.ndarray
  rank: jnp.ndarray  # 0 clean, 1 noisy, 2 padding
  block: jnp.ndarray
  seg: jnp.ndarray  # the document, noisy rows; 0 on clean ones (not a sort key there)
  pos: jnp.ndarray


def sort_keys(meta: RowMeta) -> SortedKeys:
  """The keys of `meta` (1-D, one sequence) in (rank, block, seg, pos) order."""
  rank = jnp.where(meta.seg == 0, 2, jnp.where(meta.stream == CLEAN, 0, 1)).astype(jnp.int32)
  seg = jnp.where(rank == 1, meta.seg, 0)
  columns = (rank, meta.block, seg, meta.pos)
  order = jnp.lexsort(columns[::-1])  # lexsort: the last key is the primary one
  return SortedKeys(order.astype(jnp.int32), *(c[order] for c in columns))


def _first_at_least(keys: SortedKeys, *query) -> jnp.ndarray:
  """int32 [Rq]: the first sorted index whose (rank, block, seg, pos) prefix is >= `query`
  (a tuple of int32 [Rq], lexicographic), by a vectorised binary search."""
  columns = (keys.rank, keys.block, keys.seg, keys.pos)[:len(query)]
  n = keys.rank.shape[0]

  def below(idx):  # is the key at idx lexicographically less than the query?
    less, equal = jnp.zeros_like(idx, bool), jnp.ones_like(idx, bool)
    for col, q in zip(columns, query):
      c = col[jnp.minimum(idx, n - 1)]
      less, equal = less | (equal & (c < q)), equal & (c == q)
    return less

  def step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    go_right = below(mid) & (lo < hi)
    return jnp.where(go_right, mid + 1, lo), jnp.where(go_right | (lo >= hi), hi, mid)

  lo = jnp.zeros_like(query[0])
  _, hi = jax.lax.fori_loop(0, max(1, n.bit_length()), step, (lo, lo + n))
  return hi


def key_intervals(q_meta: RowMeta, keys: SortedKeys):
  """((lo, hi) against the clean keys, (lo, hi) against the noisy keys), int32 [Rq] each:
  the sorted-key interval each query may see in that stream (documents apart, for the clean
  one: segment ids compare them)."""
  clean_q, padding_q = q_meta.stream == CLEAN, q_meta.seg == 0
  zero = jnp.zeros_like(q_meta.pos)
  # Clean keys: blocks before the query's (its own too, for a clean query), from its window.
  clean_hi = _first_at_least(keys, zero, q_meta.block + clean_q.astype(jnp.int32))
  clean_lo = jnp.searchsorted(jnp.where(keys.rank == 0, keys.pos, _BIG), q_meta.lo,
                              side="left").astype(jnp.int32)
  # Noisy keys: the query's own block of its own document, from its window start (which a
  # local layer's window never puts inside the block, kernels/mask.py: kept for the rule's
  # sake), to its position if causal.
  own = (zero + 1, q_meta.block, q_meta.seg)
  noisy_lo = _first_at_least(keys, *own, q_meta.lo)
  causal = q_meta.stream == NOISY_CAUSAL
  noisy_hi = _first_at_least(keys, *own, jnp.where(causal, q_meta.pos + 1, _BIG))
  none = padding_q | clean_q
  return ((jnp.where(padding_q, 0, clean_lo), jnp.where(padding_q, 0, clean_hi)),
          (jnp.where(none, 0, noisy_lo), jnp.where(none, 0, noisy_hi)))


def pack(lo, hi, start: int, size: int):
  """The interval [lo, hi) of sorted keys, cut to the call's keys [start, start + size) and
  packed into one int32 per query for `in_interval`; empty as [0, 0)."""
  lo = jnp.clip(lo - start, 0, size)
  hi = jnp.clip(hi - start, 0, size)
  return jnp.where(lo < hi, (lo << _HALF) | hi, 0).astype(jnp.int32)


def in_interval(q_value, k_index):
  """Splash's mask function: may key k_index be seen by a query whose packed interval is
  q_value? (Evaluated inside the kernel, per tile.)"""
  return (k_index >= (q_value >> _HALF)) & (k_index < (q_value & _LOW))


def _tile(rows: int) -> int:
  return min(TILE, rows)


def _padded(rows: int) -> int:
  """Rows padded to whole tiles: a multiple of 128, and of TILE past it."""
  r = -(-rows // LANES) * LANES
  return r if r <= TILE else -(-r // TILE) * TILE


def _mask_info(kinds, axis: int, q_sequence) -> smi.MaskInfo:
  """Splash's MaskInfo of one call from its tile map `kinds` [n_q, n_k]: visit the non-EMPTY
  tiles; an empty grid step keeps the last fetched tile along the walked `axis` (1: keys,
  the forward; 0: queries, dK/dV), so it loads nothing new."""
  visit = kinds != EMPTY
  index = jax.lax.broadcasted_iota(jnp.int32, kinds.shape, axis)
  data_next = jax.lax.cummax(jnp.where(visit, index, 0), axis=axis)
  return smi.MaskInfo(data_next=data_next[None], mask_next=None,
                      block_mask=visit.astype(jnp.int32)[None], partial_mask_blocks=None,
                      q_sequence=q_sequence, is_dynamic_mask=True)


class Call(NamedTuple):
  """One Splash call of one sequence: the sorted keys [start, start + size) against the
  queries, one interval each (`q_sequence` of both MaskInfos), documents by `segments`."""

  start: int
  size: int
  fwd: smi.MaskInfo  # walked query tile by query tile: the forward and dq
  dkv: smi.MaskInfo  # walked key tile by key tile
  segments: sk.SegmentIds | None


def plan_calls(q_meta: RowMeta, k_meta: RowMeta) -> tuple[jnp.ndarray, list[Call]]:
  """(key order [Rk], the Calls) of one sequence's 1-D metadata, rows padded to whole tiles."""
  rq, rk = q_meta.seg.shape[0], k_meta.seg.shape[0]
  keys = sort_keys(k_meta)
  k_sorted = RowMeta(*(x[keys.order] for x in k_meta[:4]), None)
  (c_lo, c_hi), (n_lo, n_hi) = key_intervals(q_meta, keys)
  only = lambda rank: k_sorted._replace(seg=jnp.where(keys.rank == rank, k_sorted.seg, 0))
  streams = ((only(0), q_meta, c_lo, c_hi),
             (only(1), q_meta._replace(seg=jnp.where(q_meta.stream == CLEAN, 0, q_meta.seg)),
              n_lo, n_hi))
  q_seg = jnp.where(q_meta.seg == 0, -1, q_meta.seg)
  size = min(MAX_KEYS, rk)
  calls = []
  for start in range(0, rk, size):
    for stream, (k_rows, q_rows, lo, hi) in enumerate(streams):
      k_rows = jax.tree.map(lambda x: x[start:start + size], k_rows)
      kinds = tile_kinds(*(jax.tree.map(lambda x: x[None], m) for m in (q_rows, k_rows)),
                         _tile(rq), _tile(size), jnp)[0]
      q_sequence = pack(lo, hi, start, size)
      # Clean keys: documents compared here; a noisy interval holds one document already.
      segments = (sk.SegmentIds(q_seg, jnp.where(k_rows.seg == 0, -2, k_rows.seg))
                  if stream == 0 else None)
      calls.append(Call(start, size, _mask_info(kinds, 1, q_sequence),
                        _mask_info(kinds, 0, q_sequence), segments))
  return keys.order, calls


def _block_sizes(rq: int, size: int) -> sk.BlockSizes:
  bq, bk = _tile(rq), _tile(size)
  return sk.BlockSizes(block_q=bq, block_kv=bk, block_q_dkv=bq, block_kv_dkv=bk,
                       block_q_dq=bq, block_kv_dq=bk)


def _on_platform(fn):
  """`fn(*args, interpret=...)` compiled through Mosaic when lowered for TPU, interpreted
  when lowered for anything else."""
  def run(*args):
    return jax.lax.platform_dependent(*args, tpu=functools.partial(fn, interpret=False),
                                      default=functools.partial(fn, interpret=True))
  return run


def _heads_first(x):  # [R, H, D] -> [H, R, D]
  return jnp.swapaxes(x, 0, 1)


def _pad_rows(x, rows: int):
  return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _sequence_fwd(q, k, v, q_meta, k_meta, *, interpret):
  """(out f32 [Rq, Hq, D], lse [Rq, Hq]) of one sequence; rows padded to whole tiles."""
  rq = q.shape[0]
  order, calls = plan_calls(q_meta, k_meta)
  q_h = _heads_first(q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype))
  k_h, v_h = _heads_first(k[order]), _heads_first(v[order])
  out = jnp.zeros(q_h.shape, jnp.float32)
  lse = jnp.full(q_h.shape[:2], NEG_INF, jnp.float32)
  for c in calls:
    o_c, (lse_c,) = sk._splash_attention_forward(  # noqa: SLF001 (the LSE a ring merges)
        c.fwd, q_h, k_h[:, c.start:c.start + c.size], v_h[:, c.start:c.start + c.size],
        c.segments, None, mask_value=sk.DEFAULT_MASK_VALUE, is_mqa=False,
        block_sizes=_block_sizes(rq, c.size), residual_checkpoint_name=None,
        save_residuals=True, mask_function=in_interval, interpret=interpret)
    seen = lse_c > NEG_INF  # a query with no key here: Splash leaves 0/0 or -inf
    out, lse = merge(out, lse, jnp.where(seen[..., None], o_c.astype(jnp.float32), 0.0),
                      jnp.where(seen, lse_c, NEG_INF))
  return _heads_first(out), _heads_first(lse)


def _sequence_bwd(q, k, v, q_meta, k_meta, lse, dout, delta, *, interpret):
  """(dq, dk, dv) f32 of one sequence given the global lse and delta = rowsum(dout * out)
  - dlse, [Rq, Hq] each."""
  rq = q.shape[0]
  scale = q.shape[-1] ** -0.5
  order, calls = plan_calls(q_meta, k_meta)
  q_h = _heads_first(q * jnp.asarray(scale, q.dtype))
  k_h, v_h = _heads_first(k[order]), _heads_first(v[order])
  do_h, lse_h, delta_h = _heads_first(dout), _heads_first(lse), _heads_first(delta)
  dq = jnp.zeros(q_h.shape, jnp.float32)
  dk, dv = jnp.zeros(k_h.shape, jnp.float32), jnp.zeros(v_h.shape, jnp.float32)
  common = dict(is_mqa=False, mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
                q_layout=sk.QKVLayout.HEAD_DIM_MINOR, k_layout=sk.QKVLayout.HEAD_DIM_MINOR,
                v_layout=sk.QKVLayout.HEAD_DIM_MINOR, mask_function=in_interval,
                interpret=interpret)
  for c in calls:
    keys = slice(c.start, c.start + c.size)
    args = (q_h, k_h[:, keys], v_h[:, keys], c.segments, None, lse_h, do_h, delta_h)
    bs = _block_sizes(rq, c.size)
    dq = dq + sk._splash_attention_bwd_dq(  # noqa: SLF001
        *args, bq=bs.block_q_dq, bkv=bs.block_kv_dq, mask_info=c.fwd, **common)
    _, dk_c, dv_c = sk._splash_attention_bwd_dkv(  # noqa: SLF001
        *args, bq=bs.block_q_dkv, bkv=bs.block_kv_dkv, bkv_compute=bs.block_kv_dkv_compute,
        mask_info=c.dkv, use_fused_bwd_kernel=False, **common)
    dk = dk.at[:, keys].add(dk_c)
    dv = dv.at[:, keys].add(dv_c)
  unsort = jnp.argsort(order)
  return (_heads_first(dq) * scale, _heads_first(dk)[unsort], _heads_first(dv)[unsort])


def _padded_inputs(q, k, v, q_meta: RowMeta, k_meta: RowMeta):
  """Rows padded to whole tiles (padding rows: seg 0), q's window start filled in."""
  rq, rk = _padded(q.shape[1]), _padded(k.shape[1])
  pad = lambda x, rows: jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  q_meta = q_meta._replace(lo=jnp.zeros_like(q_meta.pos) if q_meta.lo is None else q_meta.lo)
  k_meta = k_meta._replace(lo=None)
  return (pad(q, rq), pad(k, rk), pad(v, rk), jax.tree.map(lambda x: pad(x, rq), q_meta),
          jax.tree.map(lambda x: pad(x, rk), k_meta))


def _check(q, k, v):
  if jax.default_backend() == "gpu":
    raise ConfigError("model.attention_impl=splash is a TPU (Mosaic) kernel and would run "
                      "interpreted here; on a GPU set model.attention_impl=pallas (or xla)")
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ConfigError(f"splash attention wants q [S, Rq, Hq, D] and k, v [S, Rk, Hkv, D] of one "
                      f"shape; got q {q.shape}, k {k.shape}, v {v.shape}")
  if q.shape[2] % k.shape[2]:
    raise ConfigError(f"query heads ({q.shape[2]}) must be a multiple of K/V heads "
                      f"({k.shape[2]}) for grouped-query attention")


def attend_fwd(q, k, v, q_meta: RowMeta, k_meta: RowMeta, chunk: int = 512, into=None):
  """(out, lse) f32, merged into a ring's running (out, lse) where given one (`into`)."""
  del chunk
  _check(q, k, v)
  rows = q.shape[1]
  per_sequence = _on_platform(_sequence_fwd)
  out, lse = jax.lax.map(lambda a: per_sequence(*a), _padded_inputs(q, k, v, q_meta, k_meta))
  out, lse = out[:, :rows], lse[:, :rows]
  return (out, lse) if into is None else merge(*into, out, lse)


def attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse=None, chunk: int = 512, dq=None):
  """Gradients of this (q, k, v) block given the global out, lse and their cotangents; dq is
  added into `dq` (a ring's running f32 sum) where given."""
  del chunk
  _check(q, k, v)
  rq, rk = q.shape[1], k.shape[1]
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  q_p, k_p, v_p, qm, km = _padded_inputs(q, k, v, q_meta, k_meta)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, q_p.shape[1] - rq)] + [(0, 0)] * (x.ndim - 2))
  per_sequence = _on_platform(_sequence_bwd)
  dq_s, dk, dv = jax.lax.map(lambda a: per_sequence(*a),
                             (q_p, k_p, v_p, qm, km, pad(lse), pad(dout.astype(q.dtype)),
                              pad(delta)))
  dq_s = dq_s[:, :rq]
  return (dq_s if dq is None else dq + dq_s), dk[:, :rk], dv[:, :rk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attend(q, k, v, q_meta, k_meta, chunk=512):
  """Differentiable (out, lse) with Splash's backward; used wherever no ring is involved."""
  return _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk)[0]


def _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk):
  out, lse = attend_fwd(q, k, v, q_meta, k_meta)
  out, lse = residuals.keep(out.astype(q.dtype), lse)
  return (out, lse), (q, k, v, q_meta, k_meta, out, lse)


def _attend_bwd_rule(chunk, res, cts):
  q, k, v, q_meta, k_meta, out, lse = res
  dout, dlse = cts
  dq, dk, dv = attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


attend.defvjp(_attend_fwd_rule, _attend_bwd_rule)


def computed_pairs(q_meta: RowMeta, k_meta: RowMeta) -> int:
  """(query, key) pairs the kernels compute for one call of one sequence (NumPy or jax
  metadata, [R] or [1, R]): the visited tiles' area over both streams and every key chunk,
  padding rows included. The work Splash does, to set beside the pairs the mask allows."""
  one = lambda m, rows: RowMeta(*(jnp.pad(jnp.asarray(x, jnp.int32).reshape(-1),
                                          (0, rows - x.shape[-1])) for x in m[:4]), None)
  rq, rk = _padded(q_meta.seg.shape[-1]), _padded(k_meta.seg.shape[-1])
  q = one(q_meta, rq)._replace(lo=jnp.pad(jnp.asarray(q_meta.lo, jnp.int32).reshape(-1),
                                          (0, rq - q_meta.seg.shape[-1])))
  tiles_per_call = _visited_tiles(q, one(k_meta, rk))
  return sum(int(n) * _tile(rq) * _tile(min(MAX_KEYS, rk)) for n in tiles_per_call)


@jax.jit
def _visited_tiles(q_meta: RowMeta, k_meta: RowMeta) -> list:
  return [c.fwd.block_mask.sum() for c in plan_calls(q_meta, k_meta)[1]]
