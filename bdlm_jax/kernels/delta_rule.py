"""The gated delta rule (Gated DeltaNet's recurrence), step by step and chunked (docs/gdn.md).

Per value head the state S [K, V] follows
    S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
(the output reads the state after the update), transformers' Qwen3.5 convention. Inputs are
what the layer hands over: q (already L2-normed and scaled by K^-1/2) and k (L2-normed) per
value head, g <= 0 and beta in (0, 1). Everything runs in float32.

`chunked` is the WY (UT-transform) form of transformers' `torch_chunk_gated_delta_rule`: inside
a chunk of C rows the updates are solved as one triangular system, and only the chunks run
in sequence; `recurrent` is the step-by-step oracle it is tested against.
"""

import jax
import jax.numpy as jnp

CHUNK = 64  # rows per chunk, as transformers' and flash-linear-attention's kernels


def recurrent(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, s_BHKV):
  """(o [B, T, H, V], final state [B, H, K, V]): one `lax.scan` step per row."""
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

  def step(s, xs):
    q, k, v, g, beta = xs
    s = s * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q)

  s, o = jax.lax.scan(step, s_BHKV.astype(jnp.float32),
                      tuple(map(f32, (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))))
  return jnp.moveaxis(o, 0, 1), s


def chunked(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, s_BHKV, chunk: int = CHUNK):
  """`recurrent`'s (o, final state), chunk rows at a time (T is padded up to a multiple of
  `chunk` with rows that leave the state alone: g = 0, beta = 0)."""
  b, t, h, _ = k_BTHK.shape
  c = min(chunk, t)
  pad = -t % c
  n = (t + pad) // c

  def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...], float32, padded with zeros
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

  q, k, v, g, beta = map(chunks, (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
  cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]: log decay from the chunk's start to row i
  lower = jnp.tril(jnp.ones((c, c), bool))
  # The log decay from row j to row i, sum of g over (j, i], summed directly rather than as
  # cum_i - cum_j: with strong decays cum reaches -1e3 and the difference would lose ~1e-4 of
  # relative precision (transformers' float32 reference does). Masked before the exp, so
  # nothing overflows (or NaNs the gradient) above the diagonal.
  seg_CC = jnp.cumsum(jnp.where(jnp.tril(lower, -1), g[..., :, None], 0.0), axis=-2)
  decay_CC = jnp.exp(jnp.where(lower, seg_CC, -jnp.inf))
  k_beta = k * beta[..., None]
  # (I + strictly lower part of (k_beta k^T) * decay) is unit lower triangular: its inverse
  # applied to v_beta and to the decayed k_beta gives the chunk's WY factors u and w.
  system = jnp.where(jnp.tril(lower, -1), (k_beta @ jnp.swapaxes(k, -1, -2)) * decay_CC, 0.0)
  system = system + jnp.eye(c, dtype=system.dtype)
  rhs = (v * beta[..., None], k_beta * jnp.exp(cum)[..., None])
  u, w = jax.lax.platform_dependent(system, rhs, cpu=_solve_by_inverse, default=_solve)
  attn = (q @ jnp.swapaxes(k, -1, -2)) * decay_CC  # intra-chunk, diagonal included
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(seg_CC[..., -1, :])[..., None]  # decay from row i to the chunk's end
  last = jnp.exp(cum[..., -1])[..., None, None]

  def step(s, xs):
    u, w, attn, q_decayed, k_decayed, last = xs
    v_new = u - w @ s
    o = q_decayed @ s + attn @ v_new
    return s * last + jnp.swapaxes(k_decayed, -1, -2) @ v_new, o

  s, o = jax.lax.scan(step, s_BHKV.astype(jnp.float32),
                      (u, w, attn, q_decayed, k_decayed, last))
  o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, V]
  o = jnp.moveaxis(o, 2, 3).reshape(b, n * c, h, -1)
  return o[:, :t], s


def _solve(system, rhs):
  """system^-1 r for each r in `rhs`, `system` unit lower triangular."""
  return tuple(jax.lax.linalg.triangular_solve(system, r, left_side=True, lower=True,
                                               unit_diagonal=True) for r in rhs)


def _solve_by_inverse(system, rhs):
  """`_solve` in matmuls, for XLA:CPU: jaxlib 0.10's LAPACK kernel splits a large batch into
  tasks on XLA:CPU's intra-op pool and holds its pool thread until they ran, so when every
  pool thread runs one (simulated devices in lockstep) none runs and the step hangs
  (docs/gdn.md)."""
  inv = _unit_lower_inverse(system)
  return tuple(inv @ r for r in rhs)


def _unit_lower_inverse(a):
  """The inverse of unit lower triangular `a` [..., C, C] by doubling the diagonal blocks: the
  inverse of [[A, 0], [L, B]] is [[A^-1, 0], [-B^-1 L A^-1, B^-1]] (C padded to a power of two
  with the identity)."""
  c = a.shape[-1]
  n = 1 << (c - 1).bit_length()
  a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, n - c)] * 2) + jnp.diag(
      (jnp.arange(n) >= c).astype(a.dtype))
  inv = jnp.ones((*a.shape[:-2], n, 1, 1), a.dtype)  # the inverses of blocks of s = 1 rows
  s = 1
  while s < n:
    blocks = jnp.moveaxis(a.reshape(*a.shape[:-2], n // s, s, n // s, s), -3, -2)
    lower = jnp.moveaxis(jnp.diagonal(blocks, -1, -4, -3)[..., ::2], -1, -3)  # (2j + 1, 2j)
    top, bottom = inv[..., ::2, :, :], inv[..., 1::2, :, :]
    inv = jnp.concatenate([jnp.concatenate([top, jnp.zeros_like(top)], -1),
                           jnp.concatenate([-bottom @ lower @ top, bottom], -1)], -2)
    s *= 2
  return inv[..., 0, :c, :c]
