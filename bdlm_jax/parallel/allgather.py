"""All-gather attention over one mesh axis, written once for CP and CSBP (as the ring is).

Each rank keeps a *stay* part of its K/V local and all-gathers the *travel* part of every
rank in one collective. The `custom_vjp` keeps only local arrays for the backward and
gathers the travelling K/V again there, so a layer's saved activations stay O(L/P) and the
gathered O(L) K/V is a transient of the forward and of the backward, never a residual
(plain autodiff would save it). The travelling dK/dV return to their owners with one
reduce-scatter, in `grad_dtype`.
"""

import functools

import jax
import jax.numpy as jnp

from bdlm_jax.kernels import residuals


def _gather_all(axis, k_stay, v_stay, k_tr, v_tr, stay_meta, tr_meta):
  """[stay ; every rank's travel part] along the rows."""
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  return (jnp.concatenate([k_stay, gather(k_tr)], axis=1),
          jnp.concatenate([v_stay, gather(v_tr)], axis=1),
          stay_meta.concat(jax.tree.map(gather, tr_meta)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def allgather_attend(kernel, axis, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr, q_meta,
                     stay_meta, tr_meta):
  """(out, lse) of local queries against the local stay K/V and every rank's travel K/V."""
  return _fwd(kernel, axis, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr, q_meta,
              stay_meta, tr_meta)[0]


def _fwd(kernel, axis, chunk, grad_dtype, q, k_stay, v_stay, k_tr, v_tr, q_meta, stay_meta,
         tr_meta):
  k, v, k_meta = _gather_all(axis, k_stay, v_stay, k_tr, v_tr, stay_meta, tr_meta)
  out, lse = kernel.attend_fwd(q, k, v, q_meta, k_meta, chunk)
  out, lse = residuals.keep(out.astype(q.dtype), lse)
  return (out, lse), (q, k_stay, v_stay, k_tr, v_tr, q_meta, stay_meta, tr_meta, out, lse)


def _bwd(kernel, axis, chunk, grad_dtype, res, cts):
  q, k_stay, v_stay, k_tr, v_tr, q_meta, stay_meta, tr_meta, out, lse = res
  k, v, k_meta = _gather_all(axis, k_stay, v_stay, k_tr, v_tr, stay_meta, tr_meta)
  dq, dk, dv = kernel.attend_bwd(q, k, v, q_meta, k_meta, out, lse, *cts, chunk)
  split = k_stay.shape[1]
  scatter = lambda x: jax.lax.psum_scatter(x.astype(grad_dtype), axis, scatter_dimension=1,
                                           tiled=True)
  return (dq.astype(q.dtype), dk[:, :split].astype(k_stay.dtype),
          dv[:, :split].astype(v_stay.dtype), scatter(dk[:, split:]).astype(k_tr.dtype),
          scatter(dv[:, split:]).astype(v_tr.dtype), None, None, None)


allgather_attend.defvjp(_fwd, _bwd)
