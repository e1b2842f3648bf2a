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
  solve = lambda rhs: jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                                      unit_diagonal=True)
  u = solve(v * beta[..., None])
  w = solve(k_beta * jnp.exp(cum)[..., None])
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
