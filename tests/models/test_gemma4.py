"""Gemma 4's model features (docs/gemma4.md): global layers with their own head dim, K/V heads,
K = V and partial RoPE in stacks of their own, experts beside a dense MLP, the layer scalar.
The layers scan like a loop over them, and every strategy equals one device (loss and
gradients; the layer scalar, a fixed buffer in Hugging Face's model, gets none)."""

import functools

import jax
import numpy as np
import pytest

from bdlm_jax import ConfigError, init_params, loss_fn, make_batch, make_mesh, sample
from bdlm_jax.configure import replace
from bdlm_jax.models.pattern import layer_types
from bdlm_jax.models.transformer import layer_slots
from bdlm_jax.params import split_frozen
from tests.models.test_moe import assert_scan_equals_layer_loop
from tests.parallel import test_strategies

# Three layers, local-global and a last layer forced global: one scanned period, a remainder.
GEMMA4 = dict(n_layers=3, layer_pattern="local,global", last_layer_global=True,
              sliding_window=6, rope_local_theta=500.0, global_head_dim=16, global_n_kv_heads=1,
              attention_k_eq_v=True, global_partial_rotary_factor=0.25, v_norm=True,
              qk_norm=True, post_norms=True, scale_embeddings=True, query_pre_attn_scalar=1,
              mlp_activation="gelu_tanh", logit_softcap=30.0, layer_scalar=True,
              moe_experts=4, moe_top_k=2, moe_d_ff=16, moe_norm_topk=True,
              moe_beside_dense=True, moe_router_norm=True, moe_aux_weight=0.01)


def _cfg(strategy="none", **parallel):
  return replace(test_strategies._cfg(strategy, 4), model=GEMMA4, parallel=parallel)


# param -> (low, high) of the uniform factor it is drawn with
SCALED = {"layer_scalar": (0.5, 1.5), "expert_scale": (0.5, 1.5), "router_scale": (0.5, 1.5),
          "q_norm": (0.2, 0.5), "k_norm": (0.2, 0.5)}


def drawn_params(cfg, mesh):
  """Parameters whose layer scalars, router and expert scales are far from 1, and whose q/k
  norms are below 1 (Gemma 4 leaves attention logits unscaled: sharp attention would amplify
  float32 rounding past the tolerance)."""
  params = init_params(cfg, jax.random.key(0), mesh)
  key = iter(jax.random.split(jax.random.key(9), 64))

  def draw(path, p):
    span = next((SCALED[k.key] for k in path if getattr(k, "key", None) in SCALED), None)
    return p if span is None else p * jax.random.uniform(next(key), p.shape, p.dtype, *span)

  return jax.tree_util.tree_map_with_path(draw, params)


def loss_and_grads(cfg, mesh, logical=None):
  """(loss, gradients) of `logical` (tokens, segments, protected; default the strategy
  tests' batch) at `drawn_params`; the layer scalars' gradients are checked to be zero and
  left out."""
  batch = make_batch(cfg, *(logical or test_strategies._logical_batch()))
  step = jax.jit(jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k, cfg, mesh), has_aux=True))
  (loss, _), grads = step(drawn_params(cfg, mesh), batch, jax.random.key(7))
  grads = jax.tree.map(np.asarray, grads)
  for stack in ("layers", "global_layers"):
    assert not grads[stack].pop("layer_scalar").any()
  trained, frozen = split_frozen(cfg, grads)  # frozen routers (train.freeze): no gradient
  assert not any(g.any() for g in jax.tree.leaves(frozen))
  return float(loss), trained


@functools.cache
def _one_device():
  return loss_and_grads(_cfg(), None)


@pytest.mark.slow
def test_global_layers_have_their_own_stacks_and_scan_like_a_loop():
  """Local layers in `layers`, global ones (other head dim, one K/V head, no v_proj) in
  `global_layers`; the scanned period and the forced-global remainder take each layer's
  weights from its own stack, as a plain loop over the layers does."""
  cfg = _cfg()
  assert layer_types(cfg.model) == ("local", "global", "global")
  assert layer_slots(cfg.model) == (("layers", 0), ("global_layers", 0), ("global_layers", 1))
  params = init_params(cfg, jax.random.key(0))
  attn = params["global_layers"]["attn"]
  assert (attn["q_proj"]["kernel"].shape, attn["k_proj"]["kernel"].shape) == ((2, 32, 64),
                                                                             (2, 32, 16))
  assert "v_proj" not in attn and "v_proj" in params["layers"]["attn"]
  assert params["layers"]["dense_mlp"]["up_proj"]["kernel"].shape == (1, 32, 64)
  assert_scan_equals_layer_loop(cfg, params)


@pytest.mark.slow
def test_gemma4_features_equal_one_device_under_csbp_ring():
  cfg = _cfg("csbp_ring", seq=8)
  test_strategies.assert_close(*loss_and_grads(cfg, make_mesh(cfg)), *_one_device())


@pytest.mark.slow
def test_gemma4_features_equal_one_device_with_experts_split_remat_and_zero3():
  """cp_allgather over seq, ZeRO-3 over fsdp x seq, experts split over data x fsdp."""
  cfg = replace(_cfg("cp_allgather", data=2, fsdp=2, seq=2, expert_axes="data,fsdp",
                     moe_dispatch="all_gather"), model=dict(remat="full"))
  test_strategies.assert_close(*loss_and_grads(cfg, make_mesh(cfg)), *_one_device())


@pytest.mark.parametrize("model, message", [
    (dict(global_head_dim=7), r"model.global_head_dim=7 must be even"),
    (dict(global_n_kv_heads=3), r"model.n_heads=4 must be a multiple of model.global_n_kv_heads=3"),
    (dict(global_partial_rotary_factor=0.0), r"global_partial_rotary_factor must be in \(0, 1\]"),
    (dict(moe_experts=0, moe_beside_dense=True), r"moe_beside_dense .* model.moe_experts=0"),
    (dict(moe_beside_dense=True, post_norms=False), r"set model.post_norms=true"),
])
def test_bad_gemma4_settings_are_refused(model, message):
  with pytest.raises(ConfigError, match=message):
    replace(_cfg(), model=model)


def test_the_sampling_cache_keeps_local_and_global_kv_in_arrays_of_their_own_shapes():
  from bdlm_jax.sample import empty_cache
  cache = empty_cache(_cfg().model, 2, 12)
  assert {name: a.shape for name, a in cache.k.items()} == {
      "local": (3, 2, 12, 2, 8), "global": (3, 2, 12, 1, 16)}


@pytest.mark.slow
def test_sampling_with_the_kv_cache_equals_recomputing_the_context():
  """The cache keeps the local layers' K/V and the global layers' (other head dim and K/V
  heads, keys serving as values) in arrays of their own shapes: greedy, token for token, as
  use_cache=false (before, the cache was refused for such a model)."""
  cfg = _cfg()
  params = init_params(cfg, jax.random.key(0))
  cached, full = (sample(params, cfg, np.array([1, 2, 3, 4, 5]), jax.random.key(1),
                         max_new_tokens=8, eos_id=-1, temperature=0.0, use_cache=use_cache)
                  for use_cache in (True, False))
  assert len(cached) == 8
  np.testing.assert_array_equal(cached, full)
