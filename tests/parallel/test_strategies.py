"""Every strategy gives the single-device loss and gradients (the contract in docs/strategies.md).

Batches carry packed documents, padding and SFT-style protected tokens; block sizes cover
N = P, N = 2P, N > 2P and P < N < 2P on 8 ranks (L = 96).
"""

import functools

import jax
import numpy as np
import pytest

from bdlm_jax import ConfigError, init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace

L = 96
BLOCKS = {"N=P": 12, "N=2P": 6, "N>2P": 4, "P<N<2P": 8}  # block sizes for P = 8


def _cfg(strategy="none", block_size=4, objective="bd3lm", **parallel):
  return replace(
      Config(),
      model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                 attention_chunk=32),
      data=dict(seq_len=L), objective=dict(name=objective, block_size=block_size),
      parallel=dict(strategy=strategy, **parallel), train=dict(batch_size=4))


def _logical_batch():
  rng = np.random.default_rng(123)
  tokens = rng.integers(0, 250, (4, L))
  seg = np.sort(rng.integers(1, 4, (4, L)), axis=1)  # packed documents
  seg[:, -7:] = 0  # padding
  protected = rng.random((4, L)) < 0.25  # SFT-style prompt tokens
  return tokens, seg, protected


def _loss_and_grads(cfg, mesh, logical=None, seed=0):
  """(loss, gradients) of the `_logical_batch` (or `logical`: tokens, segments, protected) at
  parameters drawn with `seed`."""
  batch = make_batch(cfg, *(logical or _logical_batch()))
  params = init_params(cfg, jax.random.key(seed), mesh)
  step = jax.jit(jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k, cfg, mesh), has_aux=True))
  (loss, _), grads = step(params, batch, jax.random.key(7))
  return float(loss), jax.tree.map(np.asarray, grads)


@functools.cache
def _reference(block_size, objective="bd3lm"):
  return _loss_and_grads(_cfg("none", block_size, objective), None)


def _assert_matches_reference(cfg, mesh):
  ref_loss, ref_grads = _reference(cfg.objective.block_size, cfg.objective.name)
  assert_close(*_loss_and_grads(cfg, mesh), ref_loss, ref_grads)


def assert_close(loss, grads, ref_loss, ref_grads):
  """Loss and every gradient within 1e-5 (relative) of the reference's."""
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  for path, g, ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    rel = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, (jax.tree_util.keystr(path[0]), rel)


SEQ_STRATEGIES = ["cp_allgather", "cp_ring", "bp", "csbp_allgather", "csbp_ring"]


# On seq8 the layers keep their saved residuals in host memory and run over 5 chunks of each
# device's rows (the last one shorter): where and when a layer's arrays exist, never a value.
# The composed meshes below run the defaults (remat none, all rows at once), except that on
# data x fsdp x seq each layer's backward re-runs its forward, ring included (offload_input;
# an all-gather's and a windowed exchange's: tests/parallel/test_window.py).
MEMORY_FEATURES = dict(remat="offload", row_chunks=5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SEQ_STRATEGIES)
def test_loss_and_grads_equal_single_device_on_seq8(strategy):
  cfg = replace(_cfg(strategy, BLOCKS["N>2P"], seq=8), model=MEMORY_FEATURES)
  _assert_matches_reference(cfg, make_mesh(cfg))


@pytest.mark.slow
def test_balanced_cp_ring_equals_single_device_on_seq8():
  """cp_ring_balanced cuts each half into 2P chunks of whole blocks: N = 2P here."""
  cfg = replace(_cfg("cp_ring_balanced", BLOCKS["N=2P"], seq=8), model=MEMORY_FEATURES)
  _assert_matches_reference(cfg, make_mesh(cfg))


COMPOSED = [(s, dict(data=2, seq=4)) for s in SEQ_STRATEGIES + ["cp_ring_balanced"]] + [
    (s, dict(data=2, fsdp=2, seq=2))
    for s in ("cp_ring", "cp_ring_balanced", "bp", "csbp_ring")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, mesh_shape", COMPOSED,
                         ids=[f"{s}-{'_'.join(f'{k}{v}' for k, v in m.items())}"
                              for s, m in COMPOSED])
def test_loss_and_grads_equal_single_device_on_composed_meshes(strategy, mesh_shape):
  cfg = _cfg(strategy, BLOCKS["N=2P"], **mesh_shape)
  if mesh_shape.get("fsdp"):
    cfg = replace(cfg, model=dict(remat="offload_input"))
  _assert_matches_reference(cfg, make_mesh(cfg))


@pytest.mark.slow
def test_offload_period_reruns_a_ring_step_exactly():
  """remat=offload_period, both layers one scan step: the backward re-runs the step's
  forward, its ring included, then each layer's projections against the kept attention."""
  cfg = replace(_cfg("csbp_ring", BLOCKS["N=2P"], seq=8),
                model=dict(remat="offload_period", scan_period=2))
  _assert_matches_reference(cfg, make_mesh(cfg))


# (csbp_ring at N = 2P: test_offload_period_reruns_a_ring_step_exactly, the same layout.)
@pytest.mark.slow
@pytest.mark.parametrize("strategy, case", [("bp", "N=P"), ("bp", "N=2P"), ("bp", "P<N<2P"),
                                            ("csbp_ring", "N=P"), ("csbp_ring", "P<N<2P")])
def test_block_counts_around_the_rank_count(strategy, case):
  cfg = _cfg(strategy, BLOCKS[case], seq=8)
  _assert_matches_reference(cfg, make_mesh(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cp_ring", "cp_allgather"])
def test_autoregressive_objective_under_context_parallelism(strategy):
  cfg = _cfg(strategy, objective="ar", seq=8)
  _assert_matches_reference(cfg, make_mesh(cfg))


def test_fewer_blocks_than_ranks_is_an_error():
  with pytest.raises(ConfigError, match="blocks cannot be split over parallel.seq=8"):
    make_batch(_cfg("csbp_ring", 24, seq=8), *_logical_batch())


def test_strategy_that_cannot_run_the_objective_is_an_error():
  with pytest.raises(ConfigError, match="cannot run the 'ar' objective"):
    _cfg("csbp_ring", objective="ar", seq=8)


def test_batch_laid_out_for_another_strategy_is_rejected():
  batch = make_batch(_cfg("none"), *_logical_batch())  # 2L rows; bp replicates clean rows
  cfg = _cfg("bp", seq=8)
  with pytest.raises(ConfigError, match="build it with make_batch"):
    loss_fn(init_params(cfg, jax.random.key(0)), batch, jax.random.key(0), cfg, make_mesh(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["csbp_ring", "csbp_allgather"])
def test_travelling_kv_gradients_in_bf16(strategy):
  """parallel.kv_grad_dtype=bfloat16 sends dK/dV over the wire in bf16: the loss is untouched,
  the gradients stay close, and the program moves bf16 gradients."""
  cfg = replace(_cfg(strategy, BLOCKS["N>2P"], seq=8), parallel=dict(kv_grad_dtype="bfloat16"))
  mesh = make_mesh(cfg)
  ref_loss, ref_grads = _reference(cfg.objective.block_size)
  loss, grads = _loss_and_grads(cfg, mesh)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.linalg.norm(g - ref) <= 2e-2 * np.linalg.norm(ref)
  batch = make_batch(cfg, *_logical_batch())
  params = init_params(cfg, jax.random.key(0), mesh)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(7), cfg,
                                                         mesh)[0]))(params))
  collective = "ppermute" if strategy == "csbp_ring" else "reduce_scatter"
  assert any("bf16" in line and collective in line for line in jaxpr.splitlines())
