"""The layer scan and the remat policy: what a layer keeps for its backward, and what that
buys in *compiled* memory (docs/memory.md)."""

import re

import jax
import numpy as np
import pytest
from jax._src import core
from jax._src.ad_checkpoint import saved_residuals

from bdlm_jax import ConfigError, init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from tests.close import assert_trees_close

L, D, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 4, 2, 16


def _cfg(remat="full", n_layers=4, strategy="none", layers=None, **parallel):
  return replace(Config(), model=dict(d_model=D, n_layers=n_layers, n_heads=HEADS,
                                      n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, d_ff=256,
                                      attention_chunk=64, remat=remat, **(layers or {})),
                 data=dict(seq_len=L), objective=dict(block_size=16),
                 parallel=dict(strategy=strategy, **parallel), train=dict(batch_size=2))


def _loss(cfg, mesh=None):
  batch = make_batch(cfg, np.random.default_rng(0).integers(0, 250, (2, L)))
  return lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]


def _saved_per_layer(cfg, mesh=None):
  """(dtype kind, shape) of the residuals saved by the layer scan (layer axis in front)."""
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), mesh))
  return sorted((a.dtype.kind, tuple(a.shape))
                for a, source in saved_residuals(_loss(cfg, mesh), params)
                if a.shape[:1] == (cfg.model.n_layers,) and a.ndim >= 3
                and not source.startswith("from the argument"))


def test_full_remat_saves_only_layer_input_and_attention_output_and_lse():
  rows = 2 * L  # [x_t ; x_0]
  assert _saved_per_layer(_cfg("full")) == sorted([
      ("f", (4, 2, rows, D)),  # the layer input (the scan carry)
      ("f", (4, 2, rows, HEADS, HEAD_DIM)),  # attention output
      ("f", (4, 2, rows, HEADS)),  # its log-sum-exp
      *[("i", (4, 2, rows))] * 6,  # positions and the 5 row-metadata fields, 24 bytes a row
  ])


@pytest.mark.slow
def test_full_remat_never_recomputes_the_ring():
  """A recomputed ring forward would add a loop of K/V `collective-permute`s to the program;
  remat=full has exactly the permutes of remat=none (on the global layer the forward ring and
  the backward's, on the local one the windowed exchange and its reverse)."""
  permutes = {}
  for remat in ("none", "full"):
    cfg = _cfg(remat, strategy="csbp_ring", layers=dict(layer_pattern="local,global",
                                                        sliding_window=8), seq=8)
    mesh = make_mesh(cfg)
    params = init_params(cfg, jax.random.key(0), mesh)
    text = jax.jit(jax.grad(_loss(cfg, mesh))).lower(params).compile().as_text()
    permutes[remat] = sorted(re.findall(r"= (\S+) collective-permute(?:-start)?\(", text))
  assert permutes["full"] == permutes["none"]
  assert len(permutes["full"]) >= 4  # K and V, forward and backward


def _compiled_temp(cfg):
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  return jax.jit(jax.grad(_loss(cfg))).lower(params).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_full_remat_lowers_compiled_temp_memory():
  none, full = _compiled_temp(_cfg("none", n_layers=8)), _compiled_temp(_cfg("full", n_layers=8))
  assert full < 0.5 * none, (full, none)


@pytest.mark.slow
def test_layers_compile_to_one_loop_whatever_the_depth():
  """Program size does not grow with depth: the layers are one lax.scan, over one period of
  a local/global pattern (its remainder unrolled: the same at 17 layers as at 5)."""
  def hlo_lines(n_layers, **layers):
    cfg = _cfg(n_layers=n_layers, layers=layers)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return len(jax.jit(jax.grad(_loss(cfg))).lower(params).as_text().splitlines())
  assert hlo_lines(16) == hlo_lines(2)
  pattern = dict(layer_pattern="local,local,global", sliding_window=8)
  assert hlo_lines(17, **pattern) == hlo_lines(5, **pattern)


@pytest.mark.slow
def test_a_pattern_costs_no_copy_of_the_weights():
  """Weight-heavy layers (1.5 MiB each) under remat: a layer past the last whole period adds
  about its own weights to the compiled temp, not a copy of every layer's."""
  def temp(n_layers):
    cfg = replace(_cfg(n_layers=n_layers, layers=dict(
        layer_pattern="local,local,global", sliding_window=8)), model=dict(d_ff=2048))
    return _compiled_temp(cfg)
  layer_bytes = 3 * D * 2048 * 4 + 2 * D * (HEADS + KV_HEADS) * HEAD_DIM * 4
  assert temp(7) - temp(6) < 2 * layer_bytes


def _assert_same_loss_and_grads(ref_cfg, cfg, seed=0):
  params = init_params(cfg, jax.random.key(seed))
  (l0, g0), (l1, g1) = (jax.value_and_grad(_loss(c))(params) for c in (ref_cfg, cfg))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  assert_trees_close(g1, g0, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full", "offload", "offload_input", "offload_period"])
def test_remat_keeps_loss_and_grads(remat):
  _assert_same_loss_and_grads(_cfg("none", n_layers=2), _cfg(remat, n_layers=2))


@pytest.mark.slow
def test_offload_period_keeps_loss_and_grads_over_steps_and_a_remainder():
  """A local, global pattern scanned 4 layers a step: one checkpointed step of 4 layers, then
  a remainder of 1 that keeps its input alone."""
  layers = dict(layer_pattern="local,global", sliding_window=8)
  ref_cfg = _cfg("none", n_layers=5, layers=layers)
  _assert_same_loss_and_grads(
      ref_cfg, replace(ref_cfg, model=dict(remat="offload_period", scan_period=4)), seed=2)


def test_offload_saves_what_full_saves():
  """remat=offload keeps the same arrays as remat=full (their memory kind aside)."""
  assert _saved_per_layer(_cfg("offload")) == _saved_per_layer(_cfg("full"))


def test_offload_input_saves_only_the_layer_input():
  """remat=offload_input keeps the layer input with its row metadata, nothing of the
  attention: the backward re-runs it (test_strategies: exact under a ring that re-runs)."""
  rows = 2 * L
  assert _saved_per_layer(_cfg("offload_input")) == sorted(
      [("f", (4, 2, rows, D)), *[("i", (4, 2, rows))] * 6])


def test_offload_period_saves_only_each_steps_input():
  """remat=offload_period, 2 layers a scan step: the 2 steps' inputs with their row metadata
  are all the layers keep ([steps, ...]); nothing a layer deep ([layers, ...])."""
  cfg = replace(_cfg("offload_period"), model=dict(scan_period=2))
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  saved = sorted((a.dtype.kind, tuple(a.shape))
                 for a, source in saved_residuals(_loss(cfg), params)
                 if a.ndim >= 3 and not source.startswith("from the argument"))
  rows = 2 * L
  steps = [("f", (2, 2, rows, D)), *[("i", (2, 2, rows))] * 6]
  assert [s for s in saved if s[1][0] == 2 and s[1][1:2] == (2,)] == sorted(steps)
  assert not [s for s in saved if s[1][0] == cfg.model.n_layers]


def test_an_offload_period_remainder_layer_saves_only_its_input_in_host_memory():
  """5 layers scanned 4 a step: the step and the remainder layer, a step of its own, each
  keep their input with its row metadata in host memory, nothing of their attention."""
  cfg = _cfg("offload_period", n_layers=5, layers=dict(scan_period=4))
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  rows = 2 * L
  layers = sorted((a.memory_space.name, a.dtype.kind, tuple(a.shape))
                  for a, source in saved_residuals(_loss(cfg), params)
                  if a.shape[:3] == (1, 2, rows) and not source.startswith("from the argument"))
  host = core.MemorySpace.Host.name
  step = [(host, "f", (1, 2, rows, D)), *[(host, "i", (1, 2, rows))] * 6]
  assert layers == sorted(2 * step)


def test_scan_period_must_be_a_multiple_of_the_patterns_period():
  with pytest.raises(ConfigError, match="model.scan_period=3 must be a multiple .* 2"):
    _cfg(n_layers=6, layers=dict(layer_pattern="local,global", sliding_window=8,
                                 scan_period=3)).model.check()


def test_patterns_of_coprime_lengths_repeat_at_their_lcm():
  """Attention local,global and MLPs dense,moe,moe repeat every 6 layers, not every 3
  (test_moe's scan-equals-loop test runs this pair)."""
  layers = dict(layer_pattern="local,global", sliding_window=8, mlp_pattern="dense,moe,moe",
                **MOE)
  assert _cfg(n_layers=7, layers=layers).model.pattern_period == 6
  with pytest.raises(ConfigError, match="model.scan_period=3 must be a multiple .* 6"):
    _cfg(n_layers=7, layers=dict(layers, scan_period=3)).model.check()


MOE = dict(moe_experts=4, moe_top_k=2, moe_aux_weight=0.01, moe_z_weight=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [None, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_row_chunks_keep_loss_and_grads(remat, layers):
  """Each sequence's 512 rows in 5 chunks (4 of 103 rows, one of 100): the same loss, router
  losses included, and every gradient."""
  ref_cfg = _cfg(remat, n_layers=2, layers=layers)
  _assert_same_loss_and_grads(ref_cfg, replace(ref_cfg, model=dict(row_chunks=5)), seed=3)


@pytest.mark.slow
def test_row_chunks_lower_compiled_temp_memory():
  """A wide MLP (d_ff = 16 d_model) at 512 rows a sequence: its [rows, d_ff] intermediates
  dominate a layer's backward; in 8 chunks only a chunk's exist."""
  wide = lambda parts: replace(_cfg("full", n_layers=2), model=dict(d_ff=1024, row_chunks=parts))
  whole, chunked = _compiled_temp(wide(1)), _compiled_temp(wide(8))
  assert chunked < 0.6 * whole, (chunked, whole)
