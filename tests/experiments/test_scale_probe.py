"""scale_probe --quick runs end to end: one compile in a subprocess, rejected settings become
rows, and the CSV, markdown and plot are written."""

import argparse
import csv

import pytest

from experiments import scale_probe


@pytest.mark.slow
def test_quick_probe_reports_compiled_and_rejected_settings(tmp_path):
  # csbp_ring at L=32 (2 blocks on 4 ranks) and its 1-layer depth check are rejected by the
  # config; L=64 compiles.
  scale_probe.main(["--quick", "--strategies", "csbp_ring", "--out", str(tmp_path)])
  with open(tmp_path / "scale_probe_quick.csv") as f:
    rows = {(int(r["seq_len"]), int(r["layers"])): r for r in csv.DictReader(f)}
  assert sorted(rows) == [(32, 1), (32, 2), (64, 2)]
  assert "cannot be split" in rows[(32, 2)]["error"]
  ran = rows[(64, 2)]
  assert not ran["error"]
  assert min(float(ran[k]) for k in ("argument_bytes", "temp_bytes", "peak_bytes",
                                     "compile_s", "attention_bytes")) > 0
  text = (tmp_path / "scale_probe_quick.md").read_text()
  assert "| 64 | csbp_ring |" in text and "not run: 2 blocks cannot be split" in text
  assert (tmp_path / "scale_probe_quick.png").stat().st_size > 0


@pytest.mark.slow
def test_ablation_compiles_each_feature_off_next_to_all_on(tmp_path, monkeypatch):
  monkeypatch.setattr(scale_probe, "ABLATIONS", scale_probe.ABLATIONS[::3])  # 2 compiles
  scale_probe.main(["--quick", "--ablate", "--lens", "64", "--strategies", "csbp_ring",
                    "--out", str(tmp_path)])
  with open(tmp_path / "scale_probe_quick_ablation.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  assert list(rows) == [label for label, _ in scale_probe.ABLATIONS]
  assert not any(r["error"] for r in rows.values())
  on, f32 = rows["every feature on"], next(r for v, r in rows.items() if "f32 compute" in v)
  assert float(f32["attention_bytes"]) > float(on["attention_bytes"])  # f32 K/V on the wire
  text = (tmp_path / "scale_probe_quick_ablation.md").read_text()
  assert "| csbp_ring | every feature on |" in text and "| 1.00x |" in text


@pytest.mark.slow
def test_breakdown_writes_each_compiles_buffers_at_the_peak_beside_the_table(tmp_path):
  scale_probe.main(["--quick", "--breakdown", "--lens", "64", "--strategies", "csbp_ring",
                    "--depth-check", "0", "--out", str(tmp_path)])
  text = (tmp_path / "scale_probe_quick_breakdown.md").read_text()
  assert "### tiny L=64 csbp_ring (2 layers): peak" in text
  assert "| state: parameters, optimizer state |" in text and "x the bound arguments" in text
  with open(tmp_path / "scale_probe_quick.csv") as f:
    assert "breakdown" not in next(csv.reader(f))  # the table keeps its columns


def _row(**changes) -> dict:
  """A result row as `run` returns it (a tiny --quick job, its figures made up)."""
  row = dict(model="tiny", seq_len=64, strategy="csbp_ring", devices=4, layers=2, block_size=16,
             remat="full", overrides=[], standins=False, objective="bd3lm", anchors=0,
             drafter_layers=0, target="cpu", argument_bytes=10**6, temp_bytes=10**6, output_bytes=0,
             alias_bytes=0, peak_bytes=2 * 10**6, compile_s=1.0, attention_bytes=10**5,
             attention_check=1.0)
  return dict(row, **changes)


def test_a_run_keeps_the_other_models_rows_and_sections(tmp_path, monkeypatch):
  monkeypatch.setattr(scale_probe, "run", lambda args: [_row()])  # no compile: the merge only
  scale_probe.write([_row(model="other")], tmp_path / "scale_probe_quick.csv")
  md = tmp_path / "scale_probe_quick.md"
  md.write_text("## head\n\nintro\n\n### other\n\nkept\n\n### tiny\n\nstale\n")
  scale_probe.main(["--quick", "--out", str(tmp_path)])
  with open(tmp_path / "scale_probe_quick.csv") as f:
    assert [r["model"] for r in csv.DictReader(f)] == ["other", "tiny"]
  text = md.read_text()
  assert text.startswith("## head\n\nintro\n\n### other\n\nkept\n\n### tiny\n")
  assert "stale" not in text and "merged into the earlier ones" in text
  assert "| 64 | csbp_ring |" in text


def test_a_partial_run_replaces_only_the_rows_it_measured(tmp_path, monkeypatch):
  """A full table of 2 lengths x 2 strategies, then a run of one length and one strategy:
  that row's figures change, the other three stay in the CSV and the markdown."""
  full = [_row(seq_len=n, strategy=s, peak_bytes=i * 10**6)
          for i, (n, s) in enumerate([(n, s) for n in (32, 64) for s in ("cp_ring", "csbp_ring")],
                                     start=1)]
  monkeypatch.setattr(scale_probe, "run", lambda args: full)
  scale_probe.main(["--quick", "--lens", "32", "64", "--strategies", "cp_ring", "csbp_ring",
                    "--out", str(tmp_path)])
  again = _row(seq_len=64, strategy="csbp_ring", peak_bytes=9 * 10**6)
  monkeypatch.setattr(scale_probe, "run", lambda args: [again])
  scale_probe.main(["--quick", "--lens", "64", "--strategies", "csbp_ring", "--out",
                    str(tmp_path)])
  with open(tmp_path / "scale_probe_quick.csv") as f:
    peaks = {(int(r["seq_len"]), r["strategy"]): int(r["peak_bytes"]) for r in csv.DictReader(f)}
  assert peaks == {(32, "cp_ring"): 10**6, (32, "csbp_ring"): 2 * 10**6,
                   (64, "cp_ring"): 3 * 10**6, (64, "csbp_ring"): 9 * 10**6}
  text = (tmp_path / "scale_probe_quick.md").read_text()
  assert all(f"| {n} | {s} |" in text for n, s in peaks)
  assert "| 64 | csbp_ring | 1.0e-03 | 1.0e-03 | 9.0e-03 |" in text  # the new peak


def test_the_plot_has_one_legend_for_all_its_panels(tmp_path, monkeypatch):
  """Each strategy once, although the last panel lacks one, and the device's memory line."""
  import matplotlib.pyplot as plt
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  rows = [_row(model="other", strategy="cp_ring"), _row(model="other"), _row()]
  args = argparse.Namespace(models=["other", "tiny"], strategies=["cp_ring", "csbp_ring"],
                            devices=4)
  scale_probe.plot(rows, args, 1e9, tmp_path / "plot.png")
  (fig,) = figures
  assert not any(ax.get_legend() for ax in fig.axes)
  (legend,) = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == ["cp_ring", "csbp_ring", "1 GB"]
  assert (tmp_path / "plot.png").stat().st_size > 0


def test_rows_of_another_setting_are_not_merged(tmp_path, monkeypatch):
  monkeypatch.setattr(scale_probe, "run", lambda args: [_row()])
  scale_probe.write([_row(devices=8)], tmp_path / "scale_probe_quick.csv")
  with pytest.raises(SystemExit, match="pass --out"):
    scale_probe.main(["--quick", "--out", str(tmp_path)])


def test_ragged_standins_keep_the_ragged_ops_shapes(monkeypatch):
  """The stand-ins XLA:CPU compiles in place of the MoE's ragged ops have their buffers."""
  import jax
  import jax.numpy as jnp
  ragged_dot = jax.lax.ragged_dot
  monkeypatch.setattr(jax.lax, "ragged_dot", ragged_dot)  # restored after the test
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", jax.lax.ragged_all_to_all)
  monkeypatch.setattr(scale_probe.targets, "check_dispatch_runs_here",
                      scale_probe.targets.check_dispatch_runs_here)
  scale_probe._ragged_standins()
  x, w, sizes = jnp.ones((12, 4)), jnp.ones((3, 4, 5)), jnp.array([5, 0, 7], jnp.int32)
  assert jax.lax.ragged_dot(x, w, sizes).shape == ragged_dot(x, w, sizes).shape == (12, 5)
  grad = jax.grad(lambda w: jax.lax.ragged_dot(x, w, sizes).sum())(w)
  assert grad.shape == w.shape
  offsets = jnp.zeros(2, jnp.int32)
  for rows in (8, 16):  # to the experts (more slots than pairs) and back
    out = jax.lax.ragged_all_to_all(jnp.ones((12, 4)), jnp.zeros((rows, 4)), offsets, offsets,
                                    offsets, offsets, axis_name="seq")
    assert out.shape == (rows, 4)


def test_dispatch_real_compiles_the_moes_own_ragged_ops_and_xla_cpu_refuses_them_by_row():
  """--dispatch real: an MoE's second job is the ragged dispatch with no stand-ins; on the
  cpu target it is a row saying why (no subprocess, no crash)."""
  args = argparse.Namespace(models=["qwen3-30b-a3b"], lens=[4096], strategies=["csbp_ring"],
                            devices=4, layers=1, block_size=64, remat="full", objective="bd3lm",
                            anchors=0, drafter_layers=0, target="cpu", ablate=False,
                            depth_check=0, dispatch="real", set=[])
  gathered, ragged = scale_probe.jobs(args)
  assert not gathered["overrides"] and not ragged["standins"]
  assert ragged["overrides"] == ["parallel.moe_dispatch=ragged_all_to_all"]
  assert scale_probe.job_config(ragged).parallel.moe_dispatch == "ragged_all_to_all"
  row = scale_probe.measure({k: ragged[k] for k in scale_probe.KEYS}, timeout_s=1)
  assert "ragged_all_to_all cannot run on CPU" in row["error"]
  args.dispatch = "standins"
  standins = scale_probe.jobs(args)[1]
  assert standins["standins"] and not standins["overrides"]


def test_ragged_standins_compile_on_cpu_past_the_dispatch_check(monkeypatch):
  """A stand-in job reaches its worker, where the stand-ins lift the check that refuses the
  ragged dispatch on CPU (what they replace)."""
  import jax
  from bdlm_jax.analysis import targets
  from bdlm_jax.errors import ConfigError
  for name in ("ragged_dot", "ragged_all_to_all"):
    monkeypatch.setattr(jax.lax, name, getattr(jax.lax, name))  # restored after the test
  monkeypatch.setattr(targets, "check_dispatch_runs_here", targets.check_dispatch_runs_here)
  job = dict(model="qwen3-30b-a3b", seq_len=4096, strategy="csbp_ring", devices=4, layers=1,
             block_size=64, remat="full", overrides=[], standins=True, objective="bd3lm",
             anchors=0, drafter_layers=0, target="cpu")
  monkeypatch.setattr(scale_probe.isolated, "run_worker", lambda *a, **k: {"ran": True})
  assert scale_probe.measure(job, timeout_s=1) == {"ran": True}
  cfg = scale_probe.job_config(job)
  with pytest.raises(ConfigError, match="cannot run on CPU"):
    targets.check(cfg, "cpu")
  scale_probe._ragged_standins()
  targets.check(cfg, "cpu")


def test_dflash_probe_jobs_are_a_drafter_over_the_frozen_target(tmp_path, monkeypatch):
  """--objective dflash: each job is a drafter step's config (its rows written apart, in
  scale_probe_quick_dflash.*); no compile here, each job's plan traffic stands in for it."""
  from bdlm_jax.models.drafter import drafter_model
  from bdlm_jax.analysis import step_report
  jobs = []

  def measure(job, timeout_s):
    jobs.append(job)
    cfg = scale_probe.job_config(job)
    return dict(argument_bytes=1, temp_bytes=1, output_bytes=0, alias_bytes=0, peak_bytes=2,
                compile_s=1.0, attention_check=1.0,
                attention_bytes=sum(step_report.config_attention_traffic(cfg).values()))

  monkeypatch.setattr(scale_probe, "measure", measure)
  scale_probe.main(["--quick", "--objective", "dflash", "--lens", "64", "--drafter-layers", "2",
                    "--strategies", "csbp_ring", "cp_ring", "--depth-check", "0",
                    "--out", str(tmp_path)])
  cfg = scale_probe.job_config(jobs[0])
  assert (cfg.objective.name, cfg.objective.max_anchors, cfg.objective.block_size) == (
      "dflash", 4, 16)
  assert drafter_model(cfg).n_layers == 2 and cfg.model.n_layers == 2
  with open(tmp_path / "scale_probe_quick_dflash.csv") as f:
    rows = {r["strategy"]: r for r in csv.DictReader(f)}
  assert {r["objective"] for r in rows.values()} == {"dflash"}
  assert 0 < float(rows["csbp_ring"]["attention_bytes"]) < float(rows["cp_ring"]["attention_bytes"])
  text = (tmp_path / "scale_probe_quick_dflash.md").read_text()
  assert "frozen target" in text and "4 anchors; a 2-layer drafter" in text


def test_another_compilers_table_puts_each_setting_beside_xla_cpus(tmp_path, monkeypatch):
  """A TPU run next to the CPU table of the same folder: the ratio of each setting both
  compiled, a verdict that changes in bold, a setting XLA:TPU refuses kept as such."""
  scale_probe.write([_row(strategy=s, peak_bytes=8 * 10**6) for s in ("cp_ring", "csbp_ring")]
                    + [_row(seq_len=32)], tmp_path / "scale_probe_quick.csv")
  tpu = [_row(target="tpu:v5p:2x2", peak_bytes=2 * 10**6, bound_bytes=3 * 10**6),
         _row(target="tpu:v5p:2x2", strategy="cp_ring", error="compile failed: OOM")]
  args = argparse.Namespace(out=str(tmp_path), target="tpu:v5p:2x2", quick=True,
                            objective="bd3lm", ablate=False, devices=4)
  text = "\n".join(scale_probe._beside_cpu(tpu, args, device_bytes=5e6))
  assert "| 64 | csbp_ring | 2.0e-03 | 3.0e-03 | 8.0e-03 | 0.25 | **no, yes** |" in text
  assert "| 64 | cp_ring | does not compile | — | 8.0e-03 | — | no, no |" in text
  assert "| 32 |" not in text  # compiled on XLA:CPU only
  on_cpu = argparse.Namespace(**dict(vars(args), target="cpu"))
  assert scale_probe._beside_cpu(tpu, on_cpu, device_bytes=5e6) == []  # a CPU table itself
