"""Analytical step time and peak memory per sequence strategy, projected to the paper's
settings, and DFlash drafter training: the model of `bdlm_jax.analysis.cost_model`, run.

  python experiments/cost_model.py --kernel-csv experiments/results/kernel_bench.csv
  python experiments/cost_model.py        # attention TFLOP/s assumed, not calibrated

Writes cost_model.{md,csv} and cost_model_dflash.csv under --out and refreshes
README_results.md there. Memory is the compiled one where `--probe-csv` (scale_probe's
output) has the setting.
"""

import argparse
import csv
import os

from bdlm_jax.analysis.cost_model.dflash import dflash_project
from bdlm_jax.analysis.cost_model.memory import load_probe
from bdlm_jax.analysis.cost_model.report import report
from bdlm_jax.analysis.cost_model.setting import SCENARIOS, Hardware, calibrate, h100
from bdlm_jax.analysis.results import write_results_readme

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_csv(rows: list[dict], path: str) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--kernel-csv", default=None,
                      help="CSV from experiments/kernel_bench.py to calibrate attention TFLOP/s")
  parser.add_argument("--probe-csv", default=os.path.join(RESULTS_DIR, "scale_probe.csv"),
                      help="compiled memory from experiments/scale_probe.py (used if present)")
  args = parser.parse_args(argv)
  hw, calibration = calibrate(Hardware(), args.kernel_csv)
  compiled = load_probe(args.probe_csv, hw) if os.path.exists(args.probe_csv) else {}
  dflash = dflash_project(h100(hw), SCENARIOS["default"])
  probe = os.path.relpath(args.probe_csv, os.path.dirname(os.path.dirname(RESULTS_DIR)))
  text, rows = report(hw, calibration, compiled, probe, dflash)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  write_csv(dflash, os.path.join(args.out, "cost_model_dflash.csv"))
  with open(os.path.join(args.out, "cost_model.md"), "w") as f:
    f.write(text)
  write_csv(rows, os.path.join(args.out, "cost_model.csv"))
  write_results_readme(args.out)


if __name__ == "__main__":
  main()
