"""The `pallas` attention: flash-attention kernels that visit only the tiles the mask needs.

Same interface and semantics as kernels/xla.py (the oracle): `attend_fwd` -> (out f32, lse),
`attend_bwd(..., out, lse, dout, dlse, chunk, dq)` -> (dq, dk, dv) f32 given the *global* out
and lse (plus a running `dq` where given), and the differentiable `attend`. The mask comes
from row metadata (kernels/mask.py). A block-sparse tile map (kernels/tiles.py), built from
the same metadata, lists for each tile the tiles it meets: FULL ones first (no mask
arithmetic), then PARTIAL ones (masked); EMPTY tiles are never loaded. Grouped-query
attention reads K/V head h // G in place.

Three `pl.pallas_call`s, each a grid with BlockSpecs:
  forward  grid (q tiles, S, Hq):  online softmax over the q tile's key-tile list
  dq       grid (q tiles, S, Hq):  the same walk, accumulating dq
  dk, dv   grid (k tiles, S, Hkv): the k tile's query-tile list, times the G query heads
Scores live in the log2 domain (exp2 is the GPU's native exponential); the returned lse is
natural-log. On CPU the kernels run with interpret=True; on GPU through the Triton lowering.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.interpret import interpreted
from bdlm_jax.kernels.mask import RowMeta, allowed
from bdlm_jax.kernels.tiles import pad_meta, tile_kinds, tile_list
from bdlm_jax.kernels.xla import NEG_INF, merge

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_TILE = 16  # Triton's smallest matmul side
_SQ = getattr(pl, "squeezed", None)  # a BlockSpec dim the kernel does not see
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes in rows (powers of two, >= 16) and Triton launch settings."""

  fwd_q: int = 128
  fwd_k: int = 64
  bwd_q: int = 64
  bwd_k: int = 64
  num_warps: int = 0  # 0: 4 for head dim <= 64, else 8
  num_stages: int = 2


# Measured on an H200 (experiments/kernel_bench.py --sweep-tiles, bf16, GQA 32/8 x 128, BDLM
# mask at L = 16K): 4 warps run fwd+bwd in 44 ms against 87 ms with 8; larger backward tiles
# and 3 stages were slower or no faster (experiments/results/kernel_tiles.csv).
GPU_TILES = Tiles(num_warps=4)
GPU_TILES_F32 = Tiles(64, 32, 32, 32)  # f32 tiles take twice the shared memory
CPU_TILES = Tiles(16, 16, 16, 16)  # interpret mode: small tiles so tests exercise skipping


def default_tiles(dtype, interpret: bool) -> Tiles:
  if interpret:
    return CPU_TILES
  return GPU_TILES_F32 if jnp.dtype(dtype).itemsize == 4 else GPU_TILES


def interpret_mode() -> bool:
  """Pallas runs interpreted unless the default backend is a GPU."""
  return interpreted("pallas", jax.default_backend())


def _check(q, k, v, interpret: bool):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ConfigError(f"pallas attention wants q [S, Rq, Hq, D] and k, v [S, Rk, Hkv, D] of one "
                      f"shape; got q {q.shape}, k {k.shape}, v {v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ConfigError(f"q {q.shape} and k {k.shape} must agree on batch and head dim")
  if q.shape[2] % k.shape[2]:
    raise ConfigError(f"query heads ({q.shape[2]}) must be a multiple of K/V heads "
                      f"({k.shape[2]}) for grouped-query attention")
  dtypes = {q.dtype, k.dtype, v.dtype}
  if len(dtypes) != 1 or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ConfigError(f"pallas attention takes q, k, v of one dtype among float32, bfloat16, "
                      f"float16; got {sorted(str(d) for d in dtypes)}")
  d = q.shape[3]
  if not interpret and (d < MIN_TILE or d & (d - 1)):
    raise ConfigError(f"the GPU (Triton) pallas kernel needs a power-of-two head dim >= 16, "
                      f"e.g. 64 or 128; got {d}. Change model.d_model / model.n_heads or use "
                      f"model.attention_impl='xla'")


def _setup(q, k, v, tiles):
  """(interpret?, tiles) after checking that the kernel can take these inputs."""
  interpret = interpret_mode()
  _check(q, k, v, interpret)
  return interpret, tiles or default_tiles(q.dtype, interpret)


def _fit(tile: int, rows: int) -> int:
  """The tile size for `rows` rows: `tile`, shrunk (to a power of two >= 16) for short inputs."""
  return min(tile, max(MIN_TILE, pl.next_power_of_2(rows)))


def _pad_rows(x, multiple: int):
  pad = -x.shape[1] % multiple
  return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _call(kernel, *, grid, in_specs, out_specs, out_shape, interpret, head_dim, tiles, name):
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    params_cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    warps = tiles.num_warps or (4 if head_dim <= 64 else 8)
    params = dict(compiler_params=params_cls(num_warps=warps, num_stages=tiles.num_stages))
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name, **params)


# ---- in-kernel helpers (operate on one tile; run both interpreted and under Triton) -------

def _dot(a, b, contract):
  """f32 a @ b with the given contracting dims: 'nt' = a b^T, 'nn' = a b, 'tn' = a^T b."""
  dims = {"nt": ((1,), (1,)), "nn": ((1,), (0,)), "tn": ((0,), (0,))}[contract]
  return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32)


_N_META = len(RowMeta._fields)
_N_KEY_META = _N_META - 1  # keys carry no window start (`mask.as_keys`)


def _meta_at(refs, rows=Ellipsis) -> RowMeta:
  return RowMeta(*(r[rows] for r in refs))


def _split_refs(refs, *counts):
  """Cuts a kernel's trailing refs into groups: the query and key metadata (one ref per
  RowMeta field each) and the outputs."""
  groups, start = [], 0
  for n in counts:
    groups.append(refs[start:start + n])
    start += n
  return groups


def _walk(order_ref, counts_ref, visit, carry, group: int = 1):
  """Folds visit(tile, member, masked, carry) over the FULL then the PARTIAL tiles of a list.

  With group > 1 each listed tile is visited once per group member (the G query heads of a
  K/V head): loop index j covers tile order[j // group], member j % group.
  """
  def run(masked):
    def body(j, carry):
      if group == 1:
        return visit(order_ref[j], 0, masked, carry)
      return visit(order_ref[lax.div(j, group)], lax.rem(j, group), masked, carry)
    return body

  n_full = counts_ref[0] * group
  n_visit = n_full + counts_ref[1] * group
  carry = lax.fori_loop(0, n_full, run(False), carry)
  return lax.fori_loop(n_full, n_visit, run(True), carry)


def _rows(tile, size):
  return pl.ds(pl.multiple_of(tile * size, size), size)


def _q_grid_specs(tq: int, rk_pad: int, d: int, group: int, nk: int) -> dict:
  """BlockSpecs of a (q tiles, S, Hq) grid: the q tile's key-tile list and counts, q-shaped
  and lse-shaped tiles, and the whole K/V (and key metadata) of K/V head h // G."""
  return dict(
      order=pl.BlockSpec((_SQ, _SQ, nk), lambda i, b, h: (b, i, 0)),
      counts=pl.BlockSpec((_SQ, _SQ, 2), lambda i, b, h: (b, i, 0)),
      q=pl.BlockSpec((_SQ, tq, _SQ, d), lambda i, b, h: (b, i, h, 0)),
      row=pl.BlockSpec((_SQ, tq, _SQ), lambda i, b, h: (b, i, h)),
      kv=pl.BlockSpec((_SQ, rk_pad, _SQ, d), lambda i, b, h: (b, 0, lax.div(h, group), 0)),
      q_meta=[pl.BlockSpec((_SQ, tq), lambda i, b, h: (b, i))] * _N_META,
      k_meta=[pl.BlockSpec((_SQ, rk_pad), lambda i, b, h: (b, 0))] * _N_KEY_META)


# ---- forward ---------------------------------------------------------------------------------

def _fwd_kernel(order_ref, counts_ref, q_ref, k_ref, v_ref, *refs, scale, tk):
  q_refs, k_refs, (out_ref, lse_ref) = _split_refs(refs, _N_META, _N_KEY_META, 2)
  q = q_ref[...]
  q_meta = _meta_at(q_refs)
  tq, d = q.shape

  def visit(tile, _, masked, carry):
    m, l, acc = carry
    rows = _rows(tile, tk)
    s = _dot(q, k_ref[rows, :], "nt") * (scale * LOG2E)
    if masked:
      mask = allowed(q_meta, _meta_at(k_refs, rows))
      s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp2(s - m_new[:, None])
    if masked:
      p = jnp.where(mask, p, 0.0)  # a row with nothing allowed yet has m_new == NEG_INF
    corr = jnp.exp2(m - m_new)
    v = v_ref[rows, :]
    acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v, "nn")
    return m_new, l * corr + p.sum(axis=-1), acc

  init = (jnp.full((tq,), NEG_INF, _F32), jnp.zeros((tq,), _F32), jnp.zeros((tq, d), _F32))
  m, l, acc = _walk(order_ref, counts_ref, visit, init)
  nonempty = l > 0
  l_safe = jnp.where(nonempty, l, 1.0)
  out_ref[...] = (acc / l_safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, (m + jnp.log2(l_safe)) * LN2, NEG_INF)


def _forward(q, k, v, q_meta: RowMeta, k_meta: RowMeta, out_dtype, tiles):
  interpret, tiles = _setup(q, k, v, tiles)
  s, rq, hq, d = q.shape
  rk, group = k.shape[1], hq // k.shape[2]
  tq, tk = _fit(tiles.fwd_q, rq), _fit(tiles.fwd_k, rk)
  order, counts = tile_list(tile_kinds(q_meta, k_meta, tq, tk, jnp))
  q, k, v = _pad_rows(q, tq), _pad_rows(k, tk), _pad_rows(v, tk)
  q_meta, k_meta = pad_meta(q_meta, tq, jnp), pad_meta(k_meta, tk, jnp)
  nq, nk, rq_pad, rk_pad = q.shape[1] // tq, k.shape[1] // tk, q.shape[1], k.shape[1]

  g = _q_grid_specs(tq, rk_pad, d, group, nk)
  out, lse = _call(
      functools.partial(_fwd_kernel, scale=d ** -0.5, tk=tk),
      grid=(nq, s, hq),
      in_specs=[g["order"], g["counts"], g["q"], g["kv"], g["kv"], *g["q_meta"], *g["k_meta"]],
      out_specs=[g["q"], g["row"]],
      out_shape=[jax.ShapeDtypeStruct((s, rq_pad, hq, d), out_dtype),
                 jax.ShapeDtypeStruct((s, rq_pad, hq), _F32)],
      interpret=interpret, head_dim=d, tiles=tiles, name="bdlm_attention_fwd",
  )(order, counts, q, k, v, *q_meta, *k_meta[:_N_KEY_META])
  return out[:, :rq], lse[:, :rq]


def attend_fwd(q, k, v, q_meta: RowMeta, k_meta: RowMeta, chunk: int = 512, into=None,
               tiles=None):
  """(out f32 [S, Rq, Hq, D], lse f32 [S, Rq, Hq]), merged into a ring's running (out, lse)
  where given one (`into`). `chunk` is the xla path's key chunk; the kernel walks tiles
  instead (`tiles`: a Tiles, default per backend)."""
  del chunk
  out, lse = _forward(q, k, v, q_meta, k_meta, _F32, tiles)
  return (out, lse) if into is None else merge(*into, out, lse)


# ---- backward --------------------------------------------------------------------------------

def _dq_kernel(order_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               scale, tk):
  q_refs, k_refs, (dq_ref,) = _split_refs(refs, _N_META, _N_KEY_META, 1)
  q, do = q_ref[...], do_ref[...]
  lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]
  q_meta = _meta_at(q_refs)

  def visit(tile, _, masked, dq):
    rows = _rows(tile, tk)
    k, v = k_ref[rows, :], v_ref[rows, :]
    p = jnp.exp2(_dot(q, k, "nt") * (scale * LOG2E) - lse2[:, None])
    if masked:  # also zeroes the exp2 overflow of rows whose lse is NEG_INF (nothing allowed)
      p = jnp.where(allowed(q_meta, _meta_at(k_refs, rows)), p, 0.0)
    ds = p * (_dot(do, v, "nt") - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, "nn")

  dq = _walk(order_ref, counts_ref, visit, jnp.zeros(q.shape, _F32))
  dq_ref[...] = dq * scale


def _dkdv_kernel(order_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                 scale, tq, group):
  q_refs, k_refs, (dk_ref, dv_ref) = _split_refs(refs, _N_META, _N_KEY_META, 2)
  k, v = k_ref[...], v_ref[...]
  k_meta = _meta_at(k_refs)

  def visit(tile, head, masked, carry):
    dk, dv = carry
    rows = _rows(tile, tq)
    q, do = q_ref[rows, head, :], do_ref[rows, head, :]
    lse2, delta = lse_ref[rows, head] * LOG2E, delta_ref[rows, head]
    p = jnp.exp2(_dot(q, k, "nt") * (scale * LOG2E) - lse2[:, None])
    if masked:
      p = jnp.where(allowed(_meta_at(q_refs, rows), k_meta), p, 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, "tn")
    ds = p * (_dot(do, v, "nt") - delta[:, None])
    return dk + _dot(ds.astype(q.dtype), q, "tn"), dv

  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = _walk(order_ref, counts_ref, visit, (zeros, zeros), group)
  dk_ref[...] = dk * scale
  dv_ref[...] = dv


def attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse=None, chunk: int = 512,
               dq=None, tiles=None):
  """(dq, dk, dv) f32 of this (q, k, v) block given the global out, lse and their cotangents;
  `dq` (f32, q's shape: a ring's running sum) is added to the query gradient."""
  del chunk
  interpret, tiles = _setup(q, k, v, tiles)
  s, rq, hq, d = q.shape
  rk, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  tq, tk = _fit(tiles.bwd_q, rq), _fit(tiles.bwd_k, rk)
  delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)
  if dlse is not None:
    delta = delta - dlse.astype(_F32)
  kinds = tile_kinds(q_meta, k_meta, tq, tk, jnp)
  by_q, by_k = tile_list(kinds), tile_list(kinds.transpose(0, 2, 1))
  q, dout, lse, delta = (_pad_rows(x, tq) for x in (q, dout, lse, delta))
  k, v = _pad_rows(k, tk), _pad_rows(v, tk)
  q_meta, k_meta = pad_meta(q_meta, tq, jnp), pad_meta(k_meta, tk, jnp)
  nq, nk, rq_pad, rk_pad = q.shape[1] // tq, k.shape[1] // tk, q.shape[1], k.shape[1]
  scale = d ** -0.5
  call = functools.partial(_call, interpret=interpret, head_dim=d, tiles=tiles)

  # dq: one program per (q tile, sequence, query head), walking that q tile's key tiles.
  g = _q_grid_specs(tq, rk_pad, d, group, nk)
  dq_padded = call(
      functools.partial(_dq_kernel, scale=scale, tk=tk),
      grid=(nq, s, hq),
      in_specs=[g["order"], g["counts"], g["q"], g["kv"], g["kv"], g["q"], g["row"], g["row"],
                *g["q_meta"], *g["k_meta"]],
      out_specs=g["q"],
      out_shape=jax.ShapeDtypeStruct((s, rq_pad, hq, d), _F32),
      name="bdlm_attention_dq",
  )(*by_q, q, k, v, dout, lse, delta, *q_meta, *k_meta[:_N_KEY_META])

  # dk, dv: one program per (k tile, sequence, K/V head), walking query tiles x the G heads.
  kv_tile = pl.BlockSpec((_SQ, tk, _SQ, d), lambda j, b, h: (b, j, h, 0))
  q_group = pl.BlockSpec((_SQ, rq_pad, group, d), lambda j, b, h: (b, 0, h, 0))
  row_group = pl.BlockSpec((_SQ, rq_pad, group), lambda j, b, h: (b, 0, h))
  q_meta_all = pl.BlockSpec((_SQ, rq_pad), lambda j, b, h: (b, 0))
  k_meta_tile = pl.BlockSpec((_SQ, tk), lambda j, b, h: (b, j))
  dk, dv = call(
      functools.partial(_dkdv_kernel, scale=scale, tq=tq, group=group),
      grid=(nk, s, hkv),
      in_specs=[pl.BlockSpec((_SQ, _SQ, nq), lambda j, b, h: (b, j, 0)),
                pl.BlockSpec((_SQ, _SQ, 2), lambda j, b, h: (b, j, 0)),
                q_group, kv_tile, kv_tile, q_group, row_group, row_group,
                *[q_meta_all] * _N_META, *[k_meta_tile] * _N_KEY_META],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct((s, rk_pad, hkv, d), _F32)] * 2,
      name="bdlm_attention_dkdv",
  )(*by_k, q, k, v, dout, lse, delta, *q_meta, *k_meta[:_N_KEY_META])
  dq_rows = dq_padded[:, :rq]
  return (dq_rows if dq is None else dq + dq_rows), dk[:, :rk], dv[:, :rk]


# ---- differentiable entry point ----------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def attend(q, k, v, q_meta, k_meta, chunk=512, tiles=None):
  """Differentiable (out in q's dtype, lse f32); used wherever no ring is involved."""
  return _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk, tiles)[0]


def _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk, tiles):
  out, lse = residuals.keep(*_forward(q, k, v, q_meta, k_meta, q.dtype, tiles))
  return (out, lse), (q, k, v, q_meta, k_meta, out, lse)


def _attend_bwd_rule(chunk, tiles, res, cts):
  q, k, v, q_meta, k_meta, out, lse = res
  dout, dlse = cts
  dq, dk, dv = attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse, chunk, tiles=tiles)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


attend.defvjp(_attend_fwd_rule, _attend_bwd_rule)
