"""mode=plan's pick: the fastest projected step among the strategies whose compiled peak fits,
not the least attention traffic (bp sends none, yet repeats the clean prefix on every rank).

Rows are made up where the claim is about the choice; the projections are the cost model's on
small configs (no compile)."""

import numpy as np
import pytest

from bdlm_jax.analysis import hlo_stats
from bdlm_jax.analysis import plan_mode as pm
from bdlm_jax.analysis import step_report as sr
from bdlm_jax.analysis.cost_model import timing
from bdlm_jax.analysis.cost_model.timing import step_time
from bdlm_jax.analysis.cost_model.work import work_of
from bdlm_jax.configure import override, replace
from bdlm_jax.metrics import linear_flops_per_row
from bdlm_jax.parallel.layout import PAD
from bdlm_jax.parallel.registry import plan_for
from tests.analysis.test_step_report import B, L, config

GB = sr.GB
# parallel_bench's model (experiments/results/parallel_bench.md), one sequence over 8 ranks
BENCH = dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, d_ff=256)


def row(strategy, total_ms, peak_gb, attention_gb, compute_ms=0.0, device_gb=None):
  """A plan row; `device_gb`: what the device allocates (default the peak)."""
  s = total_ms / 1e3
  return dict(strategy=strategy, total_s=s, compute_s=compute_ms / 1e3,
              wait_s=s - compute_ms / 1e3, peak_bytes=peak_gb * GB,
              fit_bytes=(peak_gb if device_gb is None else device_gb) * GB,
              attention_bytes=attention_gb * GB)


def test_the_pick_is_the_fastest_that_fits_not_the_least_traffic():
  """bp sends nothing but is projected slowest; cp_allgather is fastest but does not fit."""
  rows = [row("bp", 30.0, 10, 0, compute_ms=30.0), row("csbp_ring", 10.0, 10, 1, 8.0),
          row("cp_ring", 12.0, 10, 2, 8.0), row("cp_allgather", 5.0, 90, 2, 4.0),
          dict(strategy="csbp_allgather", error="compile failed")]
  assert [r["strategy"] for r in pm.fastest_that_fit(rows, 80 * GB)] == \
      ["csbp_ring", "cp_ring", "bp"]
  chosen, runner_up, over = pm.verdict(rows, 80 * GB, "on test hardware", "XLA:CPU")
  assert chosen.startswith("chosen: csbp_ring (projected 10 ms/step on test hardware; fits: "
                           "10 GB on the device (XLA:CPU bound 10 GB) of 80 GB; the fastest of "
                           "the 3 that fit: 2 ms less K/V transfer and waiting than the "
                           "runner-up")
  assert runner_up == "runner-up: cp_ring (projected 12 ms/step, 1.2x)"
  assert over == ("faster but over 80 GB: cp_allgather (5 ms/step, 90 GB on the device "
                  "(XLA:CPU bound 90 GB))")


def test_when_one_strategy_fits_or_none_the_verdict_says_so():
  rows = [row("bp", 30.0, 10, 0), dict(row("csbp_ring", 10.0, 90, 1), compiler_peak_bytes=1)]
  assert pm.verdict(rows, 80 * GB, "on X", "XLA:TPU") == [
      "chosen: bp (projected 30 ms/step on X; fits: 10 GB on the device (XLA:TPU bound 10 GB) "
      "of 80 GB, the only strategy that does)", "runner-up: none",
      "faster but over 80 GB: csbp_ring (10 ms/step, 90 GB on the device (XLA:TPU peak 90 "
      "GB))"]
  assert pm.verdict(rows, 1 * GB, "on X", "XLA:CPU") == [
      "chosen: none (no strategy fits 1 GB per device by what XLA:CPU allocates on it)"]


def test_the_pick_goes_by_what_the_device_allocates_not_the_compilers_peak():
  """XLA:TPU's peak of 90 GB counts host-resident buffers; the device allocates 50 GB of its
  own memory: csbp_ring fits 80 GB and is the pick."""
  rows = [row("bp", 30.0, 10, 0), dict(row("csbp_ring", 10.0, 90, 1, device_gb=50),
                                       compiler_peak_bytes=90 * GB)]
  chosen, _ = pm.verdict(rows, 80 * GB, "on X", "XLA:TPU")
  assert chosen.startswith("chosen: csbp_ring (projected 10 ms/step on X; fits: 50 GB on the "
                           "device (XLA:TPU peak 90 GB) of 80 GB")


def test_the_projection_sends_the_bytes_the_table_prints():
  """The cost model's K/V bytes, in the config's dtypes, times the sequences a device holds,
  are the plan's attention bytes of the report (`config_attention_traffic`)."""
  for strategy in ("csbp_ring", "cp_allgather", "bp"):
    cfg = config(strategy, train=dict(batch_size=4))
    step = step_time(cfg.model, work_of(plan_for(cfg)), pm.mesh_hardware(8), pm.assumptions(cfg))
    assert step["comm_bytes_per_step"] * pm.sequences(cfg) == \
        hlo_stats.wire_bytes(sr.config_attention_traffic(cfg), 8)


def test_a_batch_of_sequences_pays_each_hops_latency_once():
  """bp sends nothing: 4 sequences take 4x one; a ring's hops start once for all 4."""
  hw = pm.mesh_hardware(8)
  for strategy, scales in (("bp", True), ("csbp_ring", False)):
    one, four = (pm.projected_step(config(strategy, train=dict(batch_size=n)), hw,
                                   pm.assumptions(config(strategy)))["total_s"] for n in (1, 4))
    assert (four == pytest.approx(4 * one)) == scales and four <= 4 * one * (1 + 1e-9)


@pytest.mark.parametrize("seq_len, bp_fastest", [(1024, True), (16384, False)])
def test_bp_is_projected_fastest_only_while_hop_latency_outweighs_its_repeated_prefix(
    seq_len, bp_fastest):
  """On H200s a small step is latency-bound: bp, which sends nothing, wins at parallel_bench's
  sizes (where the CPU-simulated measurement, every rank's work on shared cores, ranks it
  slowest); once compute dominates, its clean prefix repeated on every rank loses."""
  cfg = replace(config(), model=BENCH, data=dict(seq_len=seq_len))
  hw, a = pm.mesh_hardware(8), pm.assumptions(cfg)
  time = {s: pm.projected_step(override(cfg, [f"parallel.strategy={s}"]), hw, a)["total_s"]
          for s in ("bp", "csbp_ring", "cp_ring")}
  assert (min(time, key=time.get) == "bp") == bp_fastest


def test_plan_report_prints_the_projection_and_never_chooses_what_does_not_fit(monkeypatch):
  """Made-up compiled figures: bp, projected fastest on the tiny step, is over the memory."""
  def fake(strategy, peak):
    kinds = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0)
    return sr.StepReport(peak, 0, 0, 0, None, 0, 0.0, kinds, kinds, 0.0, 0.0)
  peaks = dict(bp=0.03, csbp_ring=0.005, cp_ring=0.006)
  monkeypatch.setattr(sr, "compare_strategies",
                      lambda *_: [(s, fake(s, gb * GB)) for s, gb in peaks.items()])
  lines = pm.plan_report(replace(config(), plan=dict(device_memory_gb=0.01))).splitlines()
  assert "on 8x H200 (1 node x 8): 600 TFLOP/s GEMM" in lines[2]
  assert lines[4].startswith("| strategy | attention | projected ms/step | arguments GB |")
  chosen, runner_up, over = lines[-3:]
  assert chosen.startswith("chosen: csbp_ring (projected ")
  assert runner_up.startswith("runner-up: cp_ring (projected ")
  assert over.startswith("faster but over 0.01 GB: bp (")


def test_on_one_seq_rank_the_plan_compiles_none_once_and_says_so(monkeypatch):
  """parallel.seq=1: every strategy is the single-device one; only it is compiled."""
  asked = []

  def fake(cfg, strategies, *_):
    asked.extend(strategies)
    kinds = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0)
    return [(s, sr.StepReport(GB, 0, 0, 0, None, 0, 0.0, kinds, kinds, 0.0, 0.0))
            for s in strategies]
  monkeypatch.setattr(sr, "compare_strategies", fake)
  text = pm.plan_report(config(seq=1))
  assert asked == ["none"]
  assert "One seq rank: every strategy is `none` (nothing splits a sequence), compiled once." \
      in text
  table = [line for line in text.splitlines() if line.startswith("| ")]
  assert len(table) == 2 and table[1].startswith("| none |")  # the header, one row
  assert "the only strategy compiled)" in text and "runner-up: none" in text


def test_bp_computes_less_than_one_device_only_by_the_unread_last_clean_block():
  """Why the cost model projected bp faster than `none` on one rank (the quickstart's 3%):
  bp's plan leaves out the last block's clean rows (B rows: no noisy block reads them, no
  label sits there, `counted_rows`), which `none` lays out. On P ranks bp's rows, summed,
  never fall below one device's counted rows, and its projected compute on one rank is
  `none`'s less exactly those B rows' linear layers and the pairs their queries make."""
  one = plan_for(config("none", seq=1))
  bp = plan_for(config("bp", seq=1))
  assert bp.rows_per_rank == one.rows_per_rank - B
  np.testing.assert_array_equal(bp.rows[0], one.rows[0][one.counted_rows])
  for p in (2, 4, 8):
    assert (plan_for(config("bp", seq=p)).rows != PAD).sum() >= one.counted_rows.sum()
  cfg = config(seq=1)
  hw, a = pm.mesh_hardware(1), pm.assumptions(cfg)
  compute = {s: pm.projected_step(override(cfg, [f"parallel.strategy={s}"]), hw, a)["compute_s"]
             for s in ("none", "bp")}
  last_block_pairs = B * L  # each clean query of the last block sees every clean key
  assert work_of(one).stay_pairs.sum() - work_of(bp).stay_pairs.sum() == last_block_pairs
  m = cfg.model
  linear = B * linear_flops_per_row(m) * (3 + a.remat_forward) / (hw.matmul_tflops * 1e12)
  attention = (last_block_pairs * timing.pair_s(m, hw) * m.n_layers
               * (1 + a.attention_bwd_factor))
  assert compute["none"] - compute["bp"] == pytest.approx(linear + attention, rel=1e-9)


def test_a_tpu_target_compiles_splash_first_and_falls_back_where_it_does_not(monkeypatch):
  """plan.attention=auto: on a TPU target each strategy compiles with Splash, and with
  model.attention_impl where Splash does not compile (the table and a line say so); on
  CPU, or with plan.attention set, one implementation for every row."""
  kinds = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0)
  compiled = sr.StepReport(GB, 0, 0, 0, None, 0, 0.0, kinds, kinds, 0.0, 0.0)
  asked = []

  def fake(cfg, strategies, *_):
    impl = cfg.model.attention_impl
    asked.append((impl, list(strategies)))
    return [(s, "compile failed: boom" if (impl, s) == ("splash", "bp") else compiled)
            for s in strategies]
  monkeypatch.setattr(sr, "compare_strategies", fake)
  tpu, cpu = pm.targets.Target("tpu:v5p:2x2x1", "tpu", ()), pm.targets.Target("cpu", "cpu", ())
  out = pm.compile_each(config(), ["csbp_ring", "bp"], None, tpu, print)
  assert [(name, impl, tried) for name, impl, _, tried in out] == [
      ("csbp_ring", "splash", []), ("bp", "xla", [("splash", "compile failed: boom")])]
  assert asked == [("splash", ["csbp_ring", "bp"]), ("xla", ["bp"])]
  asked.clear()
  assert [impl for _, impl, _, _ in pm.compile_each(config(), ["bp"], None, cpu, print)] == ["xla"]
  fixed = replace(config(), plan=dict(attention="xla"))
  assert [impl for _, impl, _, _ in pm.compile_each(fixed, ["bp"], None, tpu, print)] == ["xla"]
  assert asked == [("xla", ["bp"])] * 2
