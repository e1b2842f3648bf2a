"""The compile-only step report: what one device holds and sends for the real train step.

A tiny model on the simulated CPU devices (tests/conftest.py), float32 so that compiled
collective bytes are the plan's bytes (XLA:CPU widens bf16 collectives). Each report is one
full train-step compile, shared by the tests that read it.
"""

import dataclasses
import functools
import types

import jax
import numpy as np
import pytest

from bdlm_jax.batch import abstract_batch, make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.analysis import hlo_stats
from bdlm_jax.analysis import plan_mode
from bdlm_jax.analysis import step_report as sr
from bdlm_jax.parallel.mesh import make_mesh, row_sharding
from bdlm_jax.analysis.probe import attention_layer_costs
from bdlm_jax.parallel.registry import plan_for

L, B = 128, 16
TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
            attention_chunk=32, remat="full")


def config(strategy="csbp_ring", seq=8, **sections) -> Config:
  base = dict(model=TINY, data=dict(seq_len=L), objective=dict(block_size=B),
              parallel=dict(strategy=strategy, seq=seq), train=dict(batch_size=1))
  return replace(Config(), **{**base, **sections})


@functools.cache
def report(strategy="csbp_ring", seq=8) -> sr.StepReport:
  return sr.step_report(config(strategy, seq))


@pytest.mark.parametrize("objective", ["bd3lm", "fast_dllm_v2"])
def test_abstract_batch_has_make_batchs_shapes_dtypes_and_row_sharding(objective):
  cfg = config(objective=dict(name=objective, block_size=B), train=dict(batch_size=2))
  mesh = make_mesh(cfg)
  real = make_batch(cfg, np.ones((2, L), np.int32))
  for name, spec, x in zip(real._fields, abstract_batch(cfg, mesh), real):
    if x is None:  # an optional field (a drafter's precomputed features)
      assert spec is None, name
      continue
    assert (spec.shape, spec.dtype) == (x.shape, x.dtype), name
    assert spec.sharding == row_sharding(mesh)


@pytest.mark.parametrize("strategy,window", [("cp_ring", None), ("csbp_ring", None),
                                             ("bp", None), ("csbp_ring", 5), ("cp_ring", 5)])
def test_plan_traffic_equals_the_compiled_attention_layer(strategy, window):
  """One attention layer (global, or local with window W), forward + backward, compiled
  alone: every collective byte by kind. (Alone, an all-gather layer's backward re-gather is
  merged with its forward gather by XLA; in the layer scan it is not: see the next test.)"""
  dims = dict(n_heads=4, n_kv_heads=2, head_dim=16)
  compiled = attention_layer_costs(strategy, L, 4, B, window=window, **dims)["collective_bytes"]
  kv_row = 2 * dims["n_kv_heads"] * dims["head_dim"] * 4  # K and V, float32
  plan = plan_for(config(strategy, seq=4))
  assert sr.attention_traffic(plan, kv_row, kv_row, sr.META_ROW_BYTES, 1, window) == compiled


def test_allgather_plan_traffic_matches_the_compiled_step():
  """Per layer: gather K/V forward, gather again backward, reduce-scatter dK/dV."""
  r = report("csbp_allgather")
  plan = sr.config_attention_traffic(config("csbp_allgather"))
  assert r.attention_collective_bytes["reduce-scatter"] == plan["reduce-scatter"]
  assert 0.97 <= r.attention_check <= 1.0


# remat=offload_input re-runs each layer's forward in the backward, on every transport: a ring
# (csbp_ring), an all-gather (csbp_allgather), and an all-gather beside local layers' windowed
# exchange (cp_allgather on a local, global pattern of window 5).
OFFLOAD_INPUT = {"csbp_ring": {}, "csbp_allgather": {},
                 "cp_allgather": dict(layer_pattern="local,global", sliding_window=5)}


@functools.cache
def offload_input_report(strategy) -> sr.StepReport:
  return sr.step_report(config(strategy, model=dict(TINY, remat="offload_input",
                                                    **OFFLOAD_INPUT[strategy])))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", OFFLOAD_INPUT)
def test_offload_input_counts_what_the_compiled_step_moves(strategy):
  """The re-run forward sends a ring's hops and an exchange's rows again, by hand: csbp_ring
  one more P-1 hops of its 16 clean rows' K/V + metadata per layer. An all-gather's re-run
  gather is the backward's own re-gather, merged by XLA: it gathers as under remat=full."""
  r = offload_input_report(strategy)
  assert 0.97 <= r.attention_check <= 1.0
  cfg = config(strategy, model=dict(TINY, remat="offload_input", **OFFLOAD_INPUT[strategy]))
  plan = sr.config_attention_traffic(cfg)
  full = sr.config_attention_traffic(replace(cfg, model=dict(remat="full")))
  if strategy == "csbp_ring":
    assert plan["collective-permute"] - full["collective-permute"] == 2 * 7 * 16 * (256 + 16)
  else:
    assert plan["all-gather"] == full["all-gather"] > 0
    assert plan["reduce-scatter"] == full["reduce-scatter"] > 0
  if strategy == "csbp_allgather":  # compiled beside remat=full's
    assert r.attention_collective_bytes == report("csbp_allgather").attention_collective_bytes


@pytest.mark.slow
def test_offload_period_reruns_each_attention_forward_once():
  """remat=offload_period, both layers one scan step: the backward re-runs the step's forward
  and then each layer's projections, never its attention again. The compiled ring moves what
  offload_input's re-run moves, one more P-1 hops a layer, not two."""
  cfg = config(model=dict(TINY, remat="offload_period", scan_period=2))
  r = sr.step_report(cfg)
  assert 0.97 <= r.attention_check <= 1.0
  assert sr.config_attention_traffic(cfg) == sr.config_attention_traffic(
      config(model=dict(TINY, remat="offload_input")))
  assert r.attention_collective_bytes == offload_input_report("csbp_ring") \
      .attention_collective_bytes


def test_report_figures_are_positive_and_add_up():
  r = report()
  assert min(r.argument_bytes, r.temp_bytes, r.output_bytes, r.compile_s) > 0
  assert r.peak_bytes == r.argument_bytes + r.temp_bytes + r.output_bytes - r.alias_bytes
  assert 0 < r.alias_bytes <= r.output_bytes  # the new state reuses the donated one
  for kind in hlo_stats.COLLECTIVE_KINDS:
    assert r.collective_bytes[kind] == (r.attention_collective_bytes[kind]
                                        + r.weight_collective_bytes[kind])
  assert r.weight_collective_bytes["all-gather"] > 0  # ZeRO-3 gathers every layer's weights
  assert r.attention_collective_bytes["all-gather"] == 0  # the ring only permutes
  # XLA hoists the layer-invariant metadata hops out of the layer scan: slightly below 1.
  assert 0.97 <= r.attention_check <= 1.0
  # XLA:CPU's buffer assignment: the bound, plus its constants and thread-local scratch
  assert r.bound_bytes <= r.device_allocated_bytes <= r.bound_bytes + 4096
  assert r.argument_bytes < r.device_live_bytes <= r.device_allocated_bytes
  assert r.fit_bytes == r.device_allocated_bytes == r.row()["fit_bytes"]
  assert r.fits(r.fit_bytes) and not r.fits(r.fit_bytes - 1)


def _memory(peak, host, argument=100, temp=700, output=90, alias=80) -> sr.StepReport:
  """A report of made-up memory figures (bound 100 + 700 + 90 - 80 = 810), nothing sent."""
  kinds = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0)
  return sr.StepReport(argument, temp, output, alias, peak, host, 0.0, kinds, kinds, 0.0, 0.0)


@pytest.mark.parametrize("peak, host, device", [
    (None, 0, 810), (None, 500, 810),  # XLA:CPU: no peak of its own, the bound
    (600, 0, 600), (900, 0, 900),  # nothing in host memory: the compiler's peak, even above
    (900, 500, 810), (600, 500, 600)])  # host bytes: the smaller of the peak and the bound
def test_device_peak_is_the_compilers_unless_host_memory_inflates_it(peak, host, device):
  """XLA:TPU's peak counts host-resident buffers (tests/analysis/test_tpu_target.py), so with
  any the device's peak is at most the bound of its own buffers."""
  r = _memory(peak, host)
  assert r.bound_bytes == 810 and r.peak_bytes == device
  assert r.fits(device) and not r.fits(device - 1)
  assert r.row()["peak_bytes"] == device and r.row()["host_bytes"] == host


def test_a_fit_is_judged_by_the_devices_allocation_where_the_buffer_assignment_was_read():
  """XLA:TPU's peak 900 counts 500 host bytes; the device allocates 700 of its own memory:
  the step fits 700 and is chosen at 700, whatever its peak and bound (810). A row from
  before the allocation was read fits by its peak."""
  r = dataclasses.replace(_memory(900, 500), device_allocated_bytes=700, device_live_bytes=650)
  assert (r.peak_bytes, r.fit_bytes) == (810, 700)
  assert r.fits(700) and not r.fits(699)
  rows = [dict(r.row(), strategy="csbp_ring", attention_bytes=1.0),
          dict(_memory(600, 0).row(), strategy="cp_ring", attention_bytes=2.0)]
  assert sr.fit_of(rows[1]) == 600
  assert sr.choose(rows, 700)["strategy"] == "csbp_ring"
  assert sr.choose(rows, 650)["strategy"] == "cp_ring"
  assert sr.choose(rows, 599) is None
  text = "\n".join(sr.table(rows, 650))
  assert "device GB | live GB" in text and "| 7.0e-07 | 6.5e-07 |" in text and "**no**" in text


class _Compiled:
  """A compiled step's stand-in: memory_analysis() returns the given fields."""

  def __init__(self, **fields):
    self.fields = fields

  def memory_analysis(self):
    return types.SimpleNamespace(generated_code_size_in_bytes=0, **self.fields)


def test_compiled_memory_reads_every_figure_and_the_host_sizes_less_their_alias():
  """Host bytes = host arguments + temp + output - host alias; XLA:CPU's own peak (which
  leaves out temp) is dropped, XLA:TPU's kept; a jax without host fields reads 0 host bytes."""
  device = dict(argument_size_in_bytes=100, temp_size_in_bytes=700, output_size_in_bytes=90,
                alias_size_in_bytes=80, peak_memory_in_bytes=950)
  host = dict(host_argument_size_in_bytes=30, host_temp_size_in_bytes=500,
              host_output_size_in_bytes=20, host_alias_size_in_bytes=10)
  compiled = _Compiled(**device, **host)
  tpu, cpu = sr.compiled_memory(compiled, "tpu"), sr.compiled_memory(compiled, "cpu")
  assert tpu == dict(argument_bytes=100, temp_bytes=700, output_bytes=90, alias_bytes=80,
                     compiler_peak_bytes=950, host_bytes=540)
  assert cpu == dict(tpu, compiler_peak_bytes=None)
  assert sr.compiled_memory(_Compiled(**device), "tpu")["host_bytes"] == 0
  r = sr.StepReport(**tpu, compile_s=0.0, collective_bytes={}, attention_collective_bytes={},
                    attention_bytes=0.0, expected_attention_operand_bytes=0.0)
  assert (r.bound_bytes, r.peak_bytes) == (810, 810)  # 950 counts host memory


@pytest.mark.slow
def test_csbp_sends_half_the_attention_bytes_of_cp():
  """By hand, per device (P = 8, L = 128, 2 layers, f32, one sequence): a rank holds 32 rows of
  [x_t ; x_0]; all 32 travel under cp, only its 16 clean ones under csbp. A row's K+V is
  2*2*16*4 = 256 B, its dK/dV 256 B, its metadata 16 B. A ring layer sends P-1 hops of K/V +
  metadata forward, P-1 backward and P hops of dK/dV; an all-gather layer gathers K/V +
  metadata forward and again backward, and reduce-scatters the P gathered dK/dV shards."""
  ring = lambda rows: 2 * (2 * 7 * rows * (256 + 16) + 8 * rows * 256)
  assert (ring(32), ring(16)) == (374784, 187392)
  for strategy, rows in (("cp_ring", 32), ("csbp_ring", 16)):
    compiled = report(strategy).attention_collective_bytes
    assert compiled["collective-permute"] == sum(compiled.values()) == ring(rows), strategy
    assert report(strategy).attention_bytes == ring(rows)  # a permute sends its buffer once
  for strategy, rows in (("cp_allgather", 32), ("csbp_allgather", 16)):
    plan = sr.config_attention_traffic(config(strategy))
    assert plan["all-gather"] == 2 * 2 * rows * (256 + 16), strategy
    assert plan["reduce-scatter"] == 2 * 8 * rows * 256, strategy
  # Compiled, K/V and dK/dV are exact; XLA gathers some of the layer-invariant metadata once
  # for more than one use, so the all-gather lies between the K/V alone and the plan's.
  compiled = report("csbp_allgather").attention_collective_bytes
  assert 2 * 2 * 16 * 256 < compiled["all-gather"] <= 2 * 2 * 16 * (256 + 16)
  assert compiled["reduce-scatter"] == 2 * 8 * 16 * 256
  assert sum(sr.config_attention_traffic(config("bp")).values()) == 0


@pytest.mark.slow
def test_self_conditioning_pass_moves_only_clean_kv_in_its_own_shape():
  """diffusiongemma's self-conditioning runs a forward without gradient before the one it
  differentiates: under csbp_ring it sends each rank's clean K/V around the ring once more,
  forward only, and nothing else. The layers' K/V have the global shape (head dim 32, two
  K/V heads: 512 bytes a row in float32)."""
  cfg = config(model=dict(TINY, self_conditioning=True, global_head_dim=32),
               objective=dict(name="diffusiongemma", block_size=B, loss_weight="unit"))
  rows, kv, meta = 16, 2 * 2 * 32 * 4, sr.META_ROW_BYTES
  layer = (2 + 1) * 7 * rows * (kv + meta) + 8 * rows * kv
  assert sr.config_attention_traffic(cfg)["collective-permute"] == 2 * layer
  compiled = sr.step_report(cfg).attention_collective_bytes
  assert compiled["collective-permute"] == sum(compiled.values()) == 2 * layer


@pytest.mark.slow
def test_state_arguments_shrink_as_the_seq_axis_grows():
  """Parameters and optimiser moments are sharded over fsdp*seq: 4x the ranks, ~1/4 the state
  (vectors stay replicated)."""
  two, eight = report(seq=2).argument_bytes, report(seq=8).argument_bytes
  assert eight < 0.35 * two


def test_rejected_strategies_say_why_and_choose_picks_the_least_traffic_that_fits():
  cfg = config("cp_ring", objective=dict(name="ar", block_size=B))
  (name, reason), = sr.compare_strategies(cfg, ["csbp_ring"])
  assert name == "csbp_ring" and "cannot run the 'ar' objective" in reason
  rows = [dict(strategy=s, **report(s).row()) for s in ("cp_ring", "csbp_ring")]
  rows.append(dict(strategy="bp", error="not compiled"))
  assert sr.choose(rows, float("inf"))["strategy"] == "csbp_ring"
  assert sr.choose(rows, 1.0) is None
  assert any("**no**" in line for line in sr.table(rows, 1.0))


def test_plan_judges_fit_by_the_configured_memory_else_141_gb_on_cpu(monkeypatch):
  """mode=plan's verdicts: the compiled peaks are cp_ring 0.41 MB and csbp_ring 0.36 MB per
  device, so 0.4 MB (plan.device_memory_gb=0.0004) fits csbp_ring only; unset, a CPU device
  reports no memory and an H200's 141 GB is assumed."""
  assert report("csbp_ring").peak_bytes < 400_000 < report("cp_ring").peak_bytes
  monkeypatch.setattr(sr, "compare_strategies",
                      lambda *_: [(s, report(s)) for s in ("cp_ring", "csbp_ring")])
  verdicts = lambda text: {line.split(" | ")[0][2:]: line.split(" | ")[-1][:-2]
                           for line in text.splitlines() if line.startswith("| c")}
  tight = plan_mode.plan_report(replace(config(), plan=dict(device_memory_gb=0.0004)))
  assert "fits 0.0004 GB |" in tight
  assert verdicts(tight) == {"cp_ring": "**no**", "csbp_ring": "yes"}
  if jax.devices()[0].memory_stats() is None:
    roomy = plan_mode.plan_report(config())
    assert "fits 141 GB |" in roomy
    assert verdicts(roomy) == {"cp_ring": "yes", "csbp_ring": "yes"}


# A drafter (dflash) over the tiny target: its K/V (1 head of 16) are not the target's (2 of
# 16), so a count with the wrong widths, a backward through the frozen target, or the wrong
# travelling rows all show. 8 draft blocks of 4 over L = 64 context rows.
DFLASH = dict(data=dict(seq_len=64), objective=dict(name="dflash", block_size=4, max_anchors=8),
              drafter=dict(n_layers=1, n_kv_heads=1))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["csbp_ring", "csbp_allgather", "cp_ring"])
def test_dflash_plan_traffic_matches_the_compiled_step(strategy, monkeypatch):
  """The frozen target's layers send every context row's K/V forward only (no dK/dV, no
  backward hops); the drafter's layer sends its plan's travelling rows forward and back.
  Exact by kind, but for all-gathered row metadata: XLA gathers the context's once for every
  layer that shares it, so an all-gather lies between its K/V alone and K/V + metadata."""
  cfg = config(strategy, **DFLASH)
  compiled = sr.step_report(cfg).attention_collective_bytes
  plan = sr.config_attention_traffic(cfg)
  monkeypatch.setattr(sr, "META_ROW_BYTES", 0)
  kv_only = sr.config_attention_traffic(cfg)
  for kind, sent in compiled.items():
    if kind == "all-gather":
      assert kv_only[kind] <= sent <= plan[kind] and (sent > 0) == (plan[kind] > 0)
    else:
      assert sent == plan[kind], kind


@pytest.mark.slow
def test_rotating_draft_queries_sends_the_plans_bytes():
  """With the draft queries rotating (parallel.draft_transport=query) the windowed drafter's
  layer sends its queries' packets and partials; the context K/V stay. Exact but for one
  hop of metadata: XLA reuses the forward's first metadata hop in the backward."""
  drafter = dict(DFLASH["drafter"], features="f", window=8)
  cfg = config("csbp_ring", **{**DFLASH, "drafter": drafter},
               parallel=dict(strategy="csbp_ring", seq=8, draft_transport="query"))
  r = sr.step_report(cfg)
  # By hand, per hop (4 draft rows of 4 heads x 16, f32): forward Q 1024 + metadata 64 +
  # partial 4 (1024 + 64); backward Q, O, dO 3072 + metadata 64 + LSE, dLSE 128 + dQ 1024.
  plan = 7 * (1024 + 64 + 1088 + 3072 + 64 + 128 + 1024)
  assert sr.config_attention_traffic(cfg)["collective-permute"] == plan
  assert r.attention_collective_bytes == dict(sr.config_attention_traffic(cfg),
                                              **{"collective-permute": plan - 64})
  assert f"{r.attention_check:.2f}" == "1.00"


@pytest.mark.slow
def test_a_pruned_context_sends_its_kept_rows_alone():
  """With 4 of each rank's 8 context rows kept (drafter.kept_context_rows), the drafter's
  ring sends those 4 (by hand, as below: 2 (P-1) 4 (128 + 16) + P 4 128) and nothing else
  (the host chose the rows: no anchors travel); compiled and planned agree."""
  drafter = dict(DFLASH["drafter"], features="f", window=4, kept_context_rows=4)
  cfg = config("csbp_ring", **{**DFLASH, "drafter": drafter})
  want = dict.fromkeys(sr.hlo_stats.COLLECTIVE_KINDS, 0.0)
  want.update({"collective-permute": 2 * 7 * 4 * 144 + 8 * 4 * 128})
  assert sr.config_attention_traffic(cfg) == want
  assert sr.step_report(cfg).attention_collective_bytes == want


def test_dflash_traffic_is_the_targets_forward_plus_the_drafters_layers():
  """By hand, per device (P = 8, f32): 8 context rows and 4 draft rows per rank; K+V per row
  2*2*16*4 = 256 B for the target, 2*1*16*4 = 128 B for the drafter; 16 B of metadata.
  (With precomputed features the compiled step sends exactly the drafter's part too.)"""
  ctx, draft, meta, p = 8, 4, 16, 8
  target = 2 * (p - 1) * ctx * (256 + meta)  # 2 layers, forward only
  ring = lambda rows: 2 * (p - 1) * rows * (128 + meta) + p * rows * 128  # 1 drafter layer
  traffic = lambda s: sr.config_attention_traffic(config(s, **DFLASH))
  assert traffic("csbp_ring")["collective-permute"] == target + ring(ctx)
  assert traffic("cp_ring")["collective-permute"] == target + ring(ctx + draft)
  gather = traffic("csbp_allgather")
  assert gather["all-gather"] == 2 * ctx * (256 + meta) + 2 * ctx * (128 + meta)
  assert gather["reduce-scatter"] == p * ctx * 128
  assert sum(traffic("bp").values()) == 0
  # Precomputed target features (drafter.features): no target runs, the drafter's alone.
  features = config("csbp_ring", **{**DFLASH, "drafter": dict(DFLASH["drafter"], features="f")})
  assert sr.config_attention_traffic(features)["collective-permute"] == ring(ctx)
