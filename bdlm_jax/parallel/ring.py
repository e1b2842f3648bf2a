"""Ring attention over one mesh axis, written once for CP (everything travels) and CSBP
(only clean K/V travel).

Each rank keeps a *stay* part of its K/V local and passes a *travel* part around the ring
with `ppermute`. Partial results are merged with their log-sum-exp. The `custom_vjp`
backward re-circulates the travelling K/V together with their gradient accumulators, so
no rank ever holds more than one visiting shard: activation memory stays O(L/P). Each
step issues the next `ppermute` before its own compute so XLA can overlap the two.
Forward: P-1 K/V hops. Backward: P-1 K/V hops and P dK/dV hops (the last brings them home).
The dK/dV accumulators travel in `grad_dtype` (float32 unless configured otherwise).
"""

import functools

import jax
import jax.numpy as jnp

from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.xla import NEG_INF


def partial_attend(kernel, chunk, q, k, v, q_meta, k_meta, into=None):
  """(out, lse) in float32 of q against one K/V part, merged into the running (out, lse) of
  the parts before where given (`into`: the kernel merges tile by tile, so no second whole
  f32 output exists beside the running one); an empty part contributes nothing."""
  if k.shape[1] == 0:
    if into is not None:
      return into
    out = jnp.zeros_like(q, jnp.float32)  # zeros_like keeps q's varying mesh axes
    return out, out[..., 0] + NEG_INF
  return kernel.attend_fwd(q, k, v, q_meta, k_meta, chunk, into=into)


def partial_grads(kernel, chunk, q, k, v, q_meta, k_meta, out, lse, dout, dlse, dq=None):
  """(dq, dk, dv) in float32 of one K/V part, dq added into the running `dq` where given."""
  if k.shape[1] == 0:
    return (jnp.zeros_like(q, jnp.float32) if dq is None else dq,
            jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
  return kernel.attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse, chunk, dq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def ring_attend(kernel, axis, num_ranks, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr,
                q_meta, stay_meta, tr_meta):
  """(out, lse) of local queries against the local stay K/V and every rank's travel K/V."""
  return _ring_fwd(kernel, axis, num_ranks, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr,
                   q_meta, stay_meta, tr_meta)[0]


def shift(x, axis, num_ranks):
  """`x` (a pytree) of rank i, sent to rank i + 1 around the ring."""
  return jax.lax.ppermute(x, axis, [(i, (i + 1) % num_ranks) for i in range(num_ranks)])


def _ring_fwd(kernel, axis, num_ranks, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr, q_meta,
              stay_meta, tr_meta):
  out, lse = partial_attend(kernel, chunk, q, k_stay, v_stay, q_meta, stay_meta)

  def step(carry, _):
    out, lse, kv = carry
    kv_next = shift(kv, axis, num_ranks)
    out, lse = partial_attend(kernel, chunk, q, *kv[:2], q_meta, kv[2], into=(out, lse))
    return (out, lse, kv_next), None

  (out, lse, kv), _ = jax.lax.scan(step, (out, lse, (k_tr, v_tr, tr_meta)), length=num_ranks - 1)
  out, lse = partial_attend(kernel, chunk, q, *kv[:2], q_meta, kv[2], into=(out, lse))
  out, lse = residuals.keep(out.astype(q.dtype), lse)
  return (out, lse), (q, k_stay, v_stay, k_tr, v_tr, q_meta, stay_meta, tr_meta, out, lse)


def _ring_bwd(kernel, axis, num_ranks, chunk, grad_dtype, res, cts):
  q, k_stay, v_stay, k_tr, v_tr, q_meta, stay_meta, tr_meta, out, lse = res
  dout, dlse = cts
  grads = functools.partial(partial_grads, kernel, chunk, q, out=out, lse=lse, dout=dout, dlse=dlse)
  dq, dk_stay, dv_stay = grads(k=k_stay, v=v_stay, q_meta=q_meta, k_meta=stay_meta)

  def visit(dq, kv, dkv):
    dq, dk_i, dv_i = grads(k=kv[0], v=kv[1], q_meta=q_meta, k_meta=kv[2], dq=dq)
    dkv = (dkv[0] + dk_i).astype(grad_dtype), (dkv[1] + dv_i).astype(grad_dtype)
    return dq, shift(dkv, axis, num_ranks)

  def step(carry, _):
    dq, kv, dkv = carry
    kv_next = shift(kv, axis, num_ranks)
    dq, dkv = visit(dq, kv, dkv)
    return (dq, kv_next, dkv), None

  zeros = (jnp.zeros_like(k_tr, grad_dtype), jnp.zeros_like(v_tr, grad_dtype))
  (dq, kv, dkv), _ = jax.lax.scan(step, (dq, (k_tr, v_tr, tr_meta), zeros), length=num_ranks - 1)
  dq, (dk_tr, dv_tr) = visit(dq, kv, dkv)
  return (dq.astype(q.dtype), dk_stay.astype(k_stay.dtype), dv_stay.astype(v_stay.dtype),
          dk_tr.astype(k_tr.dtype), dv_tr.astype(v_tr.dtype), None, None, None)


ring_attend.defvjp(_ring_fwd, _ring_bwd)
