"""quickstart_seeds runs the quickstart as a user does and reads what it prints."""

import pytest

from experiments import quickstart_seeds

SHORT = ["pretrain.steps=2", "train.steps=2", "eval.prompts=8", "model.n_layers=1",
         "train.warmup_steps=1"]


@pytest.mark.slow
def test_a_two_stage_run_is_read_into_both_stages_figures(tmp_path):
  row = quickstart_seeds.run_seed("configs/quickstart.py", 0, str(tmp_path / "run"), SHORT)
  assert row["config"] == "configs/quickstart.py" and row["seed"] == 0 and row["wall_s"] > 0
  for key in ("first_loss", "first_accuracy", "first_chance", "loss", "accuracy", "chance"):
    assert float(row[key]) >= 0, key
  assert row["sample"].startswith("sample: ") and row["printed"].startswith("trained 2 steps")
  assert row["printed"].splitlines()[-1] == row["sample"]
  text = quickstart_seeds.markdown([dict(row, produced="p"), dict(row, seed=1, produced="p")])
  assert "### configs/quickstart.py" in text and "| mean ± sd |" in text
  assert "stage 1 (ar) loss" in text and f"```text\n{row['printed']}\n```" in text
