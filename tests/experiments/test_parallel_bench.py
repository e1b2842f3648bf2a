"""The bench's tiny grid runs end to end (one compile per strategy) and its CSV shows what
the strategies promise: bp sends no K/V, CSBP sends half of CP's, the weight-gradient
all-reduce is the same for all."""

import csv
import dataclasses
import os

import pytest

from bdlm_jax.analysis.cost_model.projection import CSBP, STRATEGIES
from bdlm_jax.analysis.cost_model.setting import Assumptions
from bdlm_jax.analysis.cost_model.work import plan_work, step_comm_bytes
from bdlm_jax.parallel.registry import get_strategy, strategy_names
from experiments import parallel_bench as pb

pytestmark = pytest.mark.slow  # the whole file: docs/tests.md, the fast tier


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  pb.run(pb.GRIDS["tiny"], str(out), "float32", progress=lambda *_: None)
  with open(out / "parallel_bench.csv") as f:
    rows = {r["strategy"]: r for r in csv.DictReader(f)}
  return out, rows


def _f(row, column):
  return float(row[column])


def test_tiny_bench_writes_one_row_per_strategy_and_its_reports(bench):
  out, rows = bench
  assert sorted(rows) == sorted(pb.BD3LM_STRATEGIES)
  for name in ("parallel_bench.md", "strategies_measured.md", "parallel_bench_traffic.png",
               "parallel_bench_memory.png", "parallel_bench_time.png"):
    assert os.path.getsize(out / name) > 0
  assert "| 8 | 64 | csbp_ring |" in (out / "parallel_bench.md").read_text()


def test_values_are_measured_and_positive(bench):
  _, rows = bench
  for row in rows.values():
    for column in ("temp_bytes", "argument_bytes", "xla_flops", "model_flops_per_device",
                   "step_ms"):
      assert _f(row, column) > 0, (row["strategy"], column)
  ref = _f(rows[pb.BASELINE], "step_ms")
  for row in rows.values():  # each strategy's own time over the baseline's, from one run
    if row["seq"] == "1":  # one device: no cp_ring to compare with at P = 1
      assert row["time_vs_cp_ring"] == ""
      continue
    assert _f(row, "time_vs_cp_ring") == pytest.approx(_f(row, "step_ms") / ref, rel=1e-3)


def test_bp_and_one_device_send_no_attention_traffic(bench):
  _, rows = bench
  for local in strategy_names(transport="local"):
    assert _f(rows[local], "attn_wire_bytes") == 0, local
  for one in strategy_names(splits_sequences=False):
    assert _f(rows[one], "all_reduce_bytes") == 0, one


def test_csbp_sends_half_the_attention_bytes_of_cp(bench):
  _, rows = bench
  for csbp in CSBP:
    cp = strategy_names(baseline=True, transport=get_strategy(csbp).transport)[0]
    assert _f(rows[csbp], "attn_wire_bytes") == pytest.approx(
        0.5 * _f(rows[cp], "attn_wire_bytes"))


def test_weight_gradient_all_reduce_is_the_same_for_every_sharded_strategy(bench):
  _, rows = bench
  sharded = {_f(r, "all_reduce_bytes") for s, r in rows.items()
             if get_strategy(s).splits_sequences}
  assert len(sharded) == 1 and sharded.pop() > 0


def test_bp_holds_more_rows_than_csbp(bench):
  _, rows = bench
  assert _f(rows["bp"], "rows_per_rank") > _f(rows["csbp_ring"], "rows_per_rank")


def test_cost_model_predicts_the_measured_attention_bytes(bench):
  """The analytical traffic of every strategy, at the default assumptions in f32, is what
  the compiled step sends, up to the row metadata: XLA may hoist the layer-invariant
  metadata hops out of the layer scan, whole hops (one layer's, one way), never part of one."""
  _, rows = bench
  grid = pb.GRIDS["tiny"]
  (seq_len,), (seq,) = grid.seq_lens, grid.seqs
  model = pb.bench_config(grid, STRATEGIES[0], seq, seq_len, "float32").model
  f32 = Assumptions(compute_bytes=4)
  for strategy in STRATEGIES:
    work = plan_work(strategy, seq_len, grid.block_size, seq)
    sent = step_comm_bytes(work, model, f32)
    no_meta = step_comm_bytes(work, model, dataclasses.replace(f32, meta_bytes_per_row=0))
    measured = _f(rows[strategy], "attn_wire_bytes")
    assert no_meta <= measured <= sent, strategy
    if sent > no_meta:
      hops = (measured - no_meta) / ((sent - no_meta) / (2 * model.n_layers))
      assert hops == round(hops), (strategy, hops)


def test_dflash_bench_writes_its_own_results_and_matches_the_plan(tmp_path):
  """A drafter's step (frozen target forward + drafter forward/backward) compiles, runs and
  sends what its plan says; bd3lm's results stay as they are (no parallel_bench.csv), and
  its results page shows it. One strategy: tests/parallel/test_step_report.py checks the
  others."""
  (row,) = pb.main(["--objective", "dflash", "--tiny", "--strategies", "csbp_ring",
                    "--out", str(tmp_path)])
  assert sorted(os.listdir(tmp_path)) == ["parallel_bench_dflash.csv",
                                          "parallel_bench_dflash.md", "strategies_measured.md"]
  assert row["objective"] == "dflash" and 0.97 <= row["attn_check"] <= 1.0
  for column in ("attn_wire_bytes", "temp_bytes", "model_flops_per_device", "step_ms"):
    assert row[column] > 0, column
  text = (tmp_path / "parallel_bench_dflash.md").read_text()
  assert "frozen target" in text and "| 8 | 64 | csbp_ring |" in text
