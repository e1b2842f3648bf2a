"""experiments/splash_tiles.py on a tiny config: every ring step's call counted, Splash
computing at least the allowed pairs, and a table per config."""

import csv

from experiments import splash_tiles


def test_rows_count_the_plans_calls_and_never_compute_fewer_pairs_than_allowed(tmp_path):
  splash_tiles.main(["--config", "configs/tiny_csbp.py", "--strategies", "csbp_ring",
                     "cp_ring", "--out", str(tmp_path)])
  with open(tmp_path / "splash_tiles.csv") as f:
    rows = {r["strategy"]: r for r in csv.DictReader(f)}
  csbp, cp = rows["csbp_ring"], rows["cp_ring"]
  assert csbp["allowed_pairs"] == cp["allowed_pairs"]  # one mask, two layouts
  for r in (csbp, cp):  # (tiles of 128 rows: at this size padding outweighs the pairs)
    assert 0 < int(r["allowed_pairs"]) <= int(r["computed_pairs"])
  assert int(cp["calls"]) == 8 * 8  # 8 ranks, each ring step
  text = (tmp_path / "splash_tiles.md").read_text()
  assert "### configs/tiny_csbp.py" in text
  assert "Produced by `python experiments/splash_tiles.py --config configs/tiny_csbp.py" in text
