"""The `xla` attention: plain jnp, flash-style over tiles; the oracle and CPU default.

Interface shared by every implementation (docs/kernels.md):
  attend_fwd(q, k, v, q_meta, k_meta, chunk, into) -> (out, lse)
  attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse, chunk, dq) -> (dq, dk, dv)
q: [S, Rq, Hq, D]; k, v: [S, Rk, Hkv, D] (grouped-query: Hq a multiple of Hkv);
lse: f32 [S, Rq, Hq], natural log. The raw fwd/bwd return float32 (out, dq, dk, dv) so a
ring can merge and accumulate in full precision; the differentiable `attend` casts back to
the input dtypes. The backward takes the *global* out and lse, so a ring can hand it the
merged statistics of all steps, and adds its dq into the ring's running f32 sum where given
one (`dq`): the ring then holds one [Rq, Hq, D] f32 array, not that and this call's own. The
forward likewise merges its (out, lse) into the ring's running pair where given one (`into`).
The work runs in tiles of `chunk` queries x `chunk` keys, so no (Rq x Rk) score matrix, nor
an (Rq x chunk) one, is ever live: memory grows with chunk^2 per tile, and a tile of queries
visits only the key chunks its mask reaches.
"""

import functools

import jax
import jax.numpy as jnp

from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.chunking import over_row_chunks
from bdlm_jax.kernels.mask import RowMeta, allowed

NEG_INF = -1e30  # finite: exp() of it is 0 and it never makes NaN through an untaken branch


def merge(out, lse, out_i, lse_i):
  """Two partial (out, lse) of the same queries over disjoint keys, as one: a ring's steps,
  a kernel's calls."""
  lse_new = jnp.logaddexp(lse, lse_i)
  out = out * jnp.exp(lse - lse_new)[..., None] + out_i * jnp.exp(lse_i - lse_new)[..., None]
  return out, lse_new


def _chunked_keys(k, v, k_meta, chunk):
  """[S, Rk, ...] -> [n, S, chunk, ...] with padding keys marked seg=0."""
  rk = k.shape[1]
  n = -(-rk // chunk)
  pad = n * chunk - rk

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

  return split(k), split(v), jax.tree.map(split, k_meta)


def _scores(q5, k_c, mask, scale):
  """Masked f32 scores [S, Hkv, G, Rq, C]; `mask` [S, Rq, C] broadcast to them."""
  s_ = jnp.einsum("sqhgd,skhd->shgqk", q5, k_c, preferred_element_type=jnp.float32) * scale
  mask = mask[:, None, None]
  return jnp.where(mask, s_, NEG_INF), mask


def _visited_chunks(q_meta: RowMeta, km_n: RowMeta, body, init):
  """`body(carry, j, mask_j) -> carry` over the key chunks j with an allowed pair for these
  queries, in key order; the others are skipped.

  Most chunks of a BDLM mask are empty for a given query slice (other blocks' noisy keys,
  later clean blocks): skipping them is what flash kernels do with tiles, so CPU time
  follows the allowed pairs. A loop over the visited chunks' indices, not a `lax.cond` per
  chunk: XLA:CPU kept far more of the forward alive around a conditional (4x the compiled
  temp memory of a training step without remat).
  """
  nonempty = jax.lax.map(lambda km: allowed(q_meta, km).any(), km_n)
  order = jnp.argsort(~nonempty, stable=True)  # visited chunks first, each group in key order

  def step(i, carry):
    j = order[i]
    return body(carry, j, allowed(q_meta, jax.tree.map(lambda m: m[j], km_n)))

  return jax.lax.fori_loop(0, nonempty.sum(), step, init)


def _split_heads(x, hkv):
  s, r, hq, d = x.shape
  return x.reshape(s, r, hkv, hq // hkv, d)


def attend_fwd(q, k, v, q_meta: RowMeta, k_meta: RowMeta, chunk: int = 512, into=None):
  """(out, lse) f32 of q against this (k, v) block; with `into`, a running (out, lse) of the
  same queries over other keys (a ring's), each query tile's result is merged into its rows
  in place, so the call holds one tile's (out, lse) beside the running pair, not a second
  whole pair."""
  hkv = k.shape[2]
  k_n, v_n, km_n = _chunked_keys(k, v, k_meta, min(chunk, k.shape[1]))

  def tile(q, q_meta):  # one tile of queries against the key chunks it reaches
    scale = q.shape[-1] ** -0.5
    q5 = _split_heads(q, hkv)
    s, rq, hq, d = q.shape

    def visit(carry, j, mask):
      m, l, acc = carry
      s_c, mask = _scores(q5, k_n[j], mask, scale)
      m_new = jnp.maximum(m, s_c.max(-1))
      p = jnp.where(mask, jnp.exp(s_c - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      pv = jnp.einsum("shgqk,skhd->shgqd", p.astype(v.dtype), v_n[j],
                      preferred_element_type=jnp.float32)
      return m_new, l, acc * corr[..., None] + pv

    # Carries derive from q (zeros_like), so inside shard_map they vary over the same axes.
    acc0 = jnp.moveaxis(jnp.zeros_like(q5, jnp.float32), 1, 3)
    init = (acc0[..., 0] + NEG_INF, acc0[..., 0], acc0)
    m, l, acc = _visited_chunks(q_meta, km_n, visit, init)
    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[..., None]
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), NEG_INF)
    out = jnp.moveaxis(out, 3, 1).reshape(s, rq, hq, d)
    return (out, jnp.moveaxis(lse, 3, 1).reshape(s, rq, hq)), ()

  return over_row_chunks(tile, chunk, q, q_meta, into=into,
                         fold=lambda run, part: merge(*run, *part))[0]


def attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse=None, chunk: int = 512, dq=None):
  """Gradients of this (q, k, v) block given the global out, lse and their cotangents. Each
  query tile's dq is added in place into `dq` (f32, q's shape: a ring's running sum; zeros
  where not given), so no stack of the tiles' dq exists beside it."""
  hkv = k.shape[2]
  s, rk, _, d = k.shape
  k_n, v_n, km_n = _chunked_keys(k, v, k_meta, min(chunk, rk))

  def tile(q, q_meta, out, lse, dout, dlse):  # (dq, (dk, dv) of one tile of queries)
    scale = q.shape[-1] ** -0.5
    rq, hq = q.shape[1:3]
    g = hq // hkv
    q5 = _split_heads(q, hkv)
    do5 = _split_heads(dout, hkv)

    def heads_first(x):  # [S, Rq, Hq] -> [S, Hkv, G, Rq]
      return jnp.moveaxis(x.reshape(s, rq, hkv, g), 1, 3)

    delta = heads_first(jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1))
    if dlse is not None:
      delta = delta - heads_first(dlse.astype(jnp.float32))
    lse4 = heads_first(lse)

    def visit(carry, j, mask):
      dq, dk_n, dv_n = carry
      k_c, v_c = k_n[j], v_n[j]
      s_c, mask = _scores(q5, k_c, mask, scale)
      p = jnp.where(mask, jnp.exp(s_c - lse4[..., None]), 0.0)
      dv_c = jnp.einsum("shgqk,sqhgd->skhd", p.astype(dout.dtype), do5,
                        preferred_element_type=jnp.float32)
      dp = jnp.einsum("sqhgd,skhd->shgqk", do5, v_c, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
      dq = dq + jnp.einsum("shgqk,skhd->sqhgd", ds, k_c, preferred_element_type=jnp.float32)
      dk_c = jnp.einsum("shgqk,sqhgd->skhd", ds, q5, preferred_element_type=jnp.float32)
      return dq, dk_n.at[j].set(dk_c), dv_n.at[j].set(dv_c)

    zeros = lambda x: jnp.zeros_like(x, jnp.float32)
    dq, dk_n, dv_n = _visited_chunks(q_meta, km_n, visit, (zeros(q5), zeros(k_n), zeros(v_n)))
    return dq.reshape(q.shape), (dk_n, dv_n)

  dq = jnp.zeros_like(q, jnp.float32) if dq is None else dq
  dq, (dk_n, dv_n) = over_row_chunks(tile, chunk, q, q_meta, out, lse, dout, dlse, into=dq)

  def unchunk(x):
    return jnp.moveaxis(x, 0, 1).reshape(s, -1, hkv, d)[:, :rk]

  return dq, unchunk(dk_n), unchunk(dv_n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attend(q, k, v, q_meta, k_meta, chunk=512):
  """Differentiable (out, lse) with the flash backward; used wherever no ring is involved."""
  return _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk)[0]


def _attend_fwd_rule(q, k, v, q_meta, k_meta, chunk):
  out, lse = attend_fwd(q, k, v, q_meta, k_meta, chunk)
  out, lse = residuals.keep(out.astype(q.dtype), lse)
  return (out, lse), (q, k, v, q_meta, k_meta, out, lse)


def _attend_bwd_rule(chunk, res, cts):
  q, k, v, q_meta, k_meta, out, lse = res
  dout, dlse = cts
  dq, dk, dv = attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse, chunk)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


attend.defvjp(_attend_fwd_rule, _attend_bwd_rule)


def attend_dense(q, k, v, q_meta, k_meta):
  """Materialises the whole score matrix: the simplest possible oracle, for tests only."""
  hkv = k.shape[2]
  q5 = _split_heads(q, hkv)
  s_, mask = _scores(q5, k, allowed(q_meta, k_meta), q.shape[-1] ** -0.5)
  m = s_.max(-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s_ - m), 0.0)
  l = p.sum(-1, keepdims=True)
  out = jnp.einsum("shgqk,skhd->sqhgd", p / jnp.where(l > 0, l, 1.0), v.astype(jnp.float32))
  lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)),
                  NEG_INF)
  s, rq, hq, _ = q.shape
  return out.reshape(q.shape).astype(q.dtype), jnp.moveaxis(lse, 3, 1).reshape(s, rq, hq)
