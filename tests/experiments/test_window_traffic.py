"""The window-traffic benchmark runs end to end on its smoke grid and reports what the
windowed exchange promises: a local layer moves less than a global one, csbp less than cp."""

import csv

from bdlm_jax.parallel.registry import get_strategy
from experiments import window_traffic as wt


def test_smoke_grid_writes_its_table_and_local_layers_move_less(tmp_path):
  rings = {get_strategy(s).travels: s for s in wt.STRATEGIES
           if get_strategy(s).transport == "ring"}  # cp_ring (all), csbp_ring (clean)
  cp, csbp = rings["all"], rings["clean"]
  rows = wt.measure("smoke", strategies=(cp, csbp), progress=lambda *_: None)
  wt.write(rows, str(tmp_path))
  with open(tmp_path / "window_traffic.csv") as f:
    got = {(r["strategy"], r["layer"]): r for r in csv.DictReader(f)}
  assert len(got) == 4 and (tmp_path / "window_traffic.png").stat().st_size > 0
  assert f"| {csbp} | local (exchange) |" in (tmp_path / "window_traffic.md").read_text()
  bytes_ = {k: float(r["attn_bytes"]) for k, r in got.items()}
  for strategy in (cp, csbp):
    assert 0 < bytes_[strategy, "local"] < bytes_[strategy, "global"] / 4
  assert bytes_[csbp, "local"] < bytes_[cp, "local"]
  local = got[csbp, "local"]
  assert int(local["rows_needed"]) <= int(local["rows_sent"])

