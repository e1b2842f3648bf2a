"""The chunked gated delta rule (WY form) equals the step-by-step recurrence, values and
gradients, with mild and strong decays and a length that is not a multiple of the chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax.kernels import delta_rule


def inputs(decay: float, t: int = 37, b: int = 2, h: int = 3, k: int = 8, v: int = 6):
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = l2(jax.random.normal(keys[0], (b, t, h, k))) * k ** -0.5
  kk = l2(jax.random.normal(keys[1], (b, t, h, k)))
  val = jax.random.normal(keys[2], (b, t, h, v))
  # Per head a decay scale from weak to strong (-decay * 2 per row at the strongest).
  g = -decay * jax.nn.softplus(jax.random.normal(keys[3], (b, t, h))) * jnp.array([0.01, 0.3, 2.0])
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  s0 = jax.random.normal(keys[5], (b, h, k, v))
  return q, kk, val, g, beta, s0


@pytest.mark.parametrize("decay", [1.0, 20.0])
def test_chunked_equals_the_recurrence_values_and_gradients(decay):
  args = inputs(decay)
  chunked = lambda *a: delta_rule.chunked(*a, chunk=16)  # 37 rows: 3 chunks, the last padded
  o_ref, s_ref = delta_rule.recurrent(*args)
  o, s = jax.jit(chunked)(*args)
  np.testing.assert_allclose(o, o_ref, atol=2e-6)
  np.testing.assert_allclose(s, s_ref, atol=2e-6)

  w_o, w_s = (jax.random.normal(jax.random.PRNGKey(i), x.shape) for i, x in enumerate((o, s)))
  scalar = lambda fn: lambda *a: (jnp.sum(fn(*a)[0] * w_o) + jnp.sum(fn(*a)[1] * w_s))
  grads_ref = jax.grad(scalar(delta_rule.recurrent), argnums=range(6))(*args)
  grads = jax.jit(jax.grad(scalar(chunked), argnums=range(6)))(*args)
  for name, got, want in zip("q k v g beta s0".split(), grads, grads_ref):
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err < 1e-5, f"d{name}: relative error {err}"


def test_chunked_calls_no_lapack_kernel_on_cpu():
  """jaxlib 0.10's CPU LAPACK kernels can deadlock XLA:CPU's intra-op pool (docs/gdn.md, "Try
  it"): on CPU the chunk's system is inverted in matmuls, here 24 rows padded to 32, values and
  gradients as the recurrence's; other platforms keep XLA's triangular solve."""
  args = inputs(1.0, t=24)
  o_ref, s_ref = delta_rule.recurrent(*args)
  o, s = jax.jit(delta_rule.chunked)(*args)
  np.testing.assert_allclose(o, o_ref, atol=2e-6)
  np.testing.assert_allclose(s, s_ref, atol=2e-6)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] ** 2)
  grads = jax.jit(jax.grad(loss(delta_rule.chunked), argnums=range(6)))
  for got, want in zip(grads(*args), jax.grad(loss(delta_rule.recurrent), argnums=range(6))(*args)):
    assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 1e-5
  program = lambda platform: grads.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  assert "lapack" not in program("cpu") and "triangular_solve" not in program("cpu")
  assert "triangular_solve" in program("cuda")


def test_a_restart_inside_a_chunk_runs_the_two_pieces_apart_values_and_gradients():
  """g = RESTART_G (models/gdn.py, a packed document's first row) at rows 5 and 23 of 37 (chunks
  of 16: mid-chunk, and in the next chunk): each piece is the recurrence alone from zeros
  (the first from s0); the state before a restart gets no gradient through what follows."""
  from bdlm_jax.models.gdn import RESTART_G
  q, k, v, g, beta, s0 = inputs(20.0)
  cuts = [0, 5, 23, 37]
  g = g.at[:, jnp.array(cuts[1:-1])].set(RESTART_G)
  chunked = jax.jit(lambda *a: delta_rule.chunked(*a, chunk=16))

  def apart(q, k, v, g, beta, s0):
    outs, s = [], s0
    for i, (a, e) in enumerate(zip(cuts, cuts[1:])):
      o, s = delta_rule.recurrent(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e], beta[:, a:e],
                                  s0 if i == 0 else jnp.zeros_like(s0))
      outs.append(o)
    return jnp.concatenate(outs, 1), s

  args = (q, k, v, g, beta, s0)
  for got, want in zip(chunked(*args), apart(*args)):
    np.testing.assert_allclose(got, want, atol=2e-6)
  w = jax.random.normal(jax.random.PRNGKey(9), v.shape)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * w) + jnp.sum(fn(*a)[1] ** 2)
  grads = jax.jit(jax.grad(loss(chunked), argnums=range(6)))(*args)
  for got, want in zip(grads, jax.grad(loss(apart), argnums=range(6))(*args)):
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert err < 1e-5, err
