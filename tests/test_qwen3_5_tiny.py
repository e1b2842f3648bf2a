"""configs/qwen3_5_tiny.py (docs/gdn.md, "Try it"): through run.py, step 1's loss under
csbp_ring on 4 of the simulated devices equals the one-device loss (1e-5 relative)."""

import json
import os

import pytest

import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "qwen3_5_tiny.py")
# One step of 2 sequences: the compile is most of it.
SETS = ["train.steps=1", "train.log_every=1", "train.batch_size=2", "train.ckpt_every=1"]


def _step1_loss(workdir, *sets) -> float:
  args = ["--config", CONFIG, "--no-progress", "--workdir", str(workdir)]
  for item in [*SETS, *sets]:
    args += ["--set", item]
  assert run.main(args) == 0
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return next(json.loads(line) for line in f)["loss"]


def test_qwen3_5_tiny_under_csbp_ring_gives_the_one_device_step_1_loss(tmp_path):
  one = _step1_loss(tmp_path / "none")
  csbp = _step1_loss(tmp_path / "csbp", "parallel.strategy=csbp_ring", "parallel.seq=4")
  assert csbp == pytest.approx(one, rel=1e-5)
