"""The window-traffic benchmark runs end to end on its smoke grid and reports what the
windowed exchange promises: a local layer moves less than a global one, csbp less than cp."""

import csv

from experiments import window_traffic as wt


def test_smoke_grid_writes_its_table_and_local_layers_move_less(tmp_path):
  rows = wt.measure("smoke", strategies=("cp_ring", "csbp_ring"), progress=lambda *_: None)
  wt.write(rows, str(tmp_path))
  with open(tmp_path / "window_traffic.csv") as f:
    got = {(r["strategy"], r["layer"]): r for r in csv.DictReader(f)}
  assert len(got) == 4 and (tmp_path / "window_traffic.png").stat().st_size > 0
  assert "| csbp_ring | local (exchange) |" in (tmp_path / "window_traffic.md").read_text()
  bytes_ = {k: float(r["attn_bytes"]) for k, r in got.items()}
  for strategy in ("cp_ring", "csbp_ring"):
    assert 0 < bytes_[strategy, "local"] < bytes_[strategy, "global"] / 4
  assert bytes_["csbp_ring", "local"] < bytes_["cp_ring", "local"]
  local = got["csbp_ring", "local"]
  assert int(local["rows_needed"]) <= int(local["rows_sent"])
