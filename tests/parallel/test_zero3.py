"""Model state sharded over every device of a data replica (fsdp x seq), weights gathered in
the compute dtype where a layer runs; and the all-gather transport saves no gathered K/V."""

import re

import jax
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from bdlm_jax import abstract_state, init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.parallel.zero3 import STATE_AXES, param_spec

L = 128


def _cfg(strategy="csbp_ring", compute_dtype="float32", **parallel):
  return replace(Config(), model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                      head_dim=16, d_ff=128, compute_dtype=compute_dtype),
                 data=dict(seq_len=L), objective=dict(block_size=8),
                 parallel=dict(strategy=strategy, **parallel), train=dict(batch_size=4))


def _state_bytes(cfg):
  """Per-device bytes of the train state (params + Adam moments)."""
  state = abstract_state(cfg, make_mesh(cfg))
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(state))


def test_state_is_sharded_over_seq_as_well_as_fsdp():
  state = abstract_state(_cfg(seq=8), make_mesh(_cfg(seq=8)))
  q = state.params["layers"]["attn"]["q_proj"]["kernel"]  # [layers, d_model, heads*head_dim]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, STATE_AXES, None)
  mu = jax.tree.leaves(state.opt_state)
  assert any(getattr(x.sharding, "spec", None) == q.sharding.spec and x.shape == q.shape
             for x in mu)  # Adam moments are sharded like their parameter


def test_per_device_state_shrinks_with_the_seq_axis():
  one, eight = _state_bytes(_cfg(seq=1, strategy="none")), _state_bytes(_cfg(seq=8))
  assert eight < one / 4, (eight, one)


def test_layer_axis_and_vectors_are_never_sharded():
  assert param_spec((4, 64), 8, stacked=True) == jax.sharding.PartitionSpec()  # per-layer norm
  assert param_spec((4, 64, 128), 8, stacked=True) == jax.sharding.PartitionSpec(
      None, None, STATE_AXES)
  assert param_spec((64,), 8) == jax.sharding.PartitionSpec()
  assert param_spec((7, 9), 8) == jax.sharding.PartitionSpec()  # indivisible: replicated


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, tie", [
    (dict(seq=8), True), (dict(fsdp=2, seq=4), True), (dict(data=2, fsdp=2, seq=2), True),
    (dict(data=2, fsdp=2, seq=2), False)])
def test_sharded_state_keeps_loss_and_grads(mesh_shape, tie):
  """Tied and untied (a head apart from the embedding, gathered once a step)."""
  model = dict(tie_embeddings=tie)
  cfg = replace(_cfg(**mesh_shape), model=model)
  mesh = make_mesh(cfg)
  tokens = np.random.default_rng(2).integers(0, 250, (4, L))

  def value_and_grad(cfg, mesh):
    params = init_params(cfg, jax.random.key(0), mesh)
    batch = make_batch(cfg, tokens)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg,
                                                        mesh)[0]))(params)

  loss, grads = value_and_grad(cfg, mesh)
  ref_loss, ref_grads = value_and_grad(replace(_cfg("none"), model=model), None)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.linalg.norm(g - ref) <= 1e-5 * np.linalg.norm(ref)


def test_layer_weights_are_cast_to_the_compute_dtype_before_they_are_gathered():
  """In the program as written (StableHLO, before the CPU compiler, which runs bf16
  collectives in f32), every gathering sharding constraint of a layer weight takes a bf16
  operand. The embedding / head ([vocab, d_model]) are gathered in f32: the chunked loss
  accumulates the head's gradient over many chunks."""
  cfg = _cfg(compute_dtype="bfloat16", seq=8)
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  batch = make_batch(cfg, np.ones((4, L), np.int32))
  text = jax.jit(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]).lower(
      params).as_text()
  whole = re.compile(r"sdy.sharding_constraint .*<@mesh, \[(\{\}, )+\{\}\]> : tensor<(.*)>")
  gathered = [m.group(2) for m in map(whole.search, text.splitlines()) if m]
  vocab = str(cfg.model.vocab_size)
  layers = [t for t in gathered if vocab not in t.split("x")]
  head = [t for t in gathered if vocab in t.split("x")]
  assert len(layers) >= 7 and all(t.endswith("bf16") for t in layers), layers
  assert head and all(t.endswith("f32") for t in head), head


@pytest.mark.parametrize("strategy", ["cp_allgather", "csbp_allgather"])
def test_allgather_transport_saves_no_gathered_kv(strategy):
  """Without remat a layer keeps arrays of [rows, width] for widths up to d_model = d_ff; a
  rank's gathered K/V (every travelling row, on each of the 8 ranks) is at least twice that.
  (remat=full would hide a plain-autodiff gather: it re-gathers in the backward.)"""
  cfg = replace(_cfg(strategy, seq=8), model=dict(d_ff=64))
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(0), mesh)
  batch = make_batch(cfg, np.ones((4, L), np.int32))
  m = cfg.model
  per_layer = batch.tokens.size * max(m.d_model, m.n_heads * m.head_dim, m.d_ff)
  saved = saved_residuals(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0], params)
  # The loss head's shard_map keeps each device's (varying) copy of the head weights it
  # already holds gathered: [devices * vocab, d_model] globally, one head per device.
  head = (mesh.size * m.vocab_size, m.d_model)
  too_big = [(a.str_short(), src) for a, src in saved
             if a.size > m.n_layers * per_layer and a.shape != head]
  assert not too_big, too_big
