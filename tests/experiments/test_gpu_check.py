"""gpu_check --dry-run: the GPU first-light script's plumbing on CPU with tiny shapes, so that it
still runs the day a GPU host is at hand: the recorded CPU losses hold under xla and pallas, the
one-device step is timed and its memory read, the 16-device probe's rows come back, and one
results file is written."""

import json
import os
import subprocess
import sys

import pytest

from experiments import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_dry_run_passes_every_check_and_writes_one_results_file(tmp_path):
  assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
  assert os.listdir(tmp_path) == ["gpu_check_dry_run.json"]
  results = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
  for impl in ("xla", "pallas"):  # XLA:CPU reproduces its own record closely
    assert results["tiny"]["losses"][impl] == pytest.approx(gpu_check.CPU_LOSSES, rel=1e-5)
  step = results["one_device_step"]
  assert step["tokens_per_s"] > 0 and step["mfu"] is None  # no peak FLOP/s for a CPU
  assert step["compiled_peak_bytes"] == step["bound_bytes"] > 0  # XLA:CPU: the bound
  rows = {r["strategy"]: r for r in results["mock_16_devices"]["rows"]}
  assert list(rows) == list(gpu_check.STRATEGIES)
  assert 0 < rows["csbp_ring"]["peak_gb"] < rows["cp_ring"]["peak_gb"]


def test_it_imports_nothing_the_gpu_image_lacks():
  """The GPU image has no grain, array_record, tensorboardX, jax-triton or tokamax."""
  blocked = ("grain", "array_record", "tensorboardX", "jax_triton", "tokamax")
  code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
          "sys.path.insert(0, 'experiments'); import gpu_check, scale_probe")
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr
