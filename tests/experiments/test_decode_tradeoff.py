"""decode_tradeoff: one row per (run, decoding), the table's means over runs, the plot."""

import argparse

from experiments import decode_tradeoff


def test_each_rule_is_a_row_and_the_table_averages_the_runs(tmp_path):
  args = argparse.Namespace(steps=[0, 1], thresholds=[0.9], factors=[1.0])
  names = [d[0] for d in decode_tradeoff.decodings(args)]
  assert names == ["fixed, one token a step", "fixed, 1 steps a block", "threshold 0.9",
                   "factor 1"]
  rows = [dict(seed=seed, decoding=name, steps_per_block=steps, threshold=threshold,
               factor=factor, prompts=8, accuracy=0.25 + 0.5 * seed, chance=0.01,
               tokens_per_forward=1.0 + i, seconds=2.0)
          for seed in (0, 1) for i, (name, steps, threshold, factor)
          in enumerate(decode_tradeoff.decodings(args))]
  assert [decode_tradeoff.rule(r) for r in rows[:4]] == [
      "fixed steps per block", "fixed steps per block", "threshold", "factor"]
  text = decode_tradeoff.table(rows, "configs/quickstart.py")
  assert "seeds [0, 1]" in text and "8 held-out prompts" in text
  assert "| threshold 0.9 | 50.0% | 1.0% | 3.00 | 2 |" in text  # (25% + 75%) / 2
  decode_tradeoff.plot(rows, str(tmp_path / "plot.png"))
  assert (tmp_path / "plot.png").stat().st_size > 0
