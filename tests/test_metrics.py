"""MetricsWriter: one metrics.jsonl row per step, also when a run restarts."""

import json

from bdlm_jax.metrics import MetricsWriter


def test_a_restart_drops_the_rows_it_trains_again_and_a_torn_last_row(tmp_path):
  """Resumed from step 4: steps 6 and 8 are trained again; 8 was cut off mid-write."""
  rows = [json.dumps({"step": step, "loss": 1.0}) for step in (2, 4, 6)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 8, "lo')
  writer = MetricsWriter(tmp_path, start=4)
  writer.write(6, {"loss": 0.5})
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert lines[:2] == rows[:2]
  assert [json.loads(line) for line in lines[2:]] == [{"step": 6, "loss": 0.5}]
