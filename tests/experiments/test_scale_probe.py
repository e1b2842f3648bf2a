"""scale_probe --quick runs end to end: one compile in a subprocess, rejected settings become
rows, and the CSV, markdown and plot are written."""

import csv

from experiments import scale_probe


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
