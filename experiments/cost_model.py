"""Analytical step time and peak memory per sequence strategy, projected to the paper's
settings, and DFlash drafter training: the model of `bdlm_jax.analysis.cost_model`, run.

  python experiments/cost_model.py --kernel-csv experiments/results/kernel_bench.csv
  python experiments/cost_model.py        # attention TFLOP/s assumed, not calibrated
  python experiments/cost_model.py --scaling --kernel-csv experiments/results/kernel_bench.csv

Writes cost_model.{md,csv}, cost_model_offload.csv (remat full vs offload, on each host
link), cost_model_dflash.csv and cost_model_dflash2.csv (the DFlash2 recipes, features from
disk, as this package runs them and under the seed's settings: its `settings` column),
cost_model_gdn.csv (Qwen3.5-27B at the seed's conversion setting: our GDN chain under
csbp_ring and cp_ring, the seed's head-parallel GDN) under --out, or with --scaling only
the strong-scaling sweep (16-128 GPUs at fixed L) to cost_model_scaling.{md,csv,png}, and
refreshes the results pages (docs/results/). Memory is the compiled one where a
`--probe-csv` (scale_probe's output) has the setting: by default XLA:GPU's, else XLA:TPU's
own peak, else XLA:CPU's every-buffer bound (scale_probe_{gpu,tpu,}.csv, those that exist),
each verdict naming it.
"""

import argparse
import csv
import os

from bdlm_jax.analysis.cost_model.dflash import (dflash2_project, dflash2_seed_project,
                                                 dflash_project)
from bdlm_jax.analysis.cost_model.hybrid import hybrid_rows
from bdlm_jax.analysis.cost_model.memory import load_probe
from bdlm_jax.analysis.cost_model.projection import (STRATEGIES, offload_on_both_links,
                                                     scaling_rows)
from bdlm_jax.analysis.cost_model.report import report, scaling_report
from bdlm_jax.analysis.cost_model.setting import SCALING_GPUS, SCENARIOS, Hardware, calibrate, h100
from bdlm_jax.analysis.plan_mode import mesh_hardware
from bdlm_jax.analysis.results import write_results_pages

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# scale_probe's compiled memory, the most realistic compiler first
PROBES = [os.path.join(RESULTS_DIR, f"scale_probe{suffix}.csv")
          for suffix in ("_gpu", "_tpu", "")]


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
  parser.add_argument("--probe-csv", nargs="+", default=PROBES,
                      help="compiled memory from experiments/scale_probe.py, the most "
                           "realistic compiler first (those present are read)")
  parser.add_argument("--scaling", action="store_true",
                      help="only the strong-scaling sweep (16-128 GPUs at fixed L)")
  args = parser.parse_args(argv)
  hw, calibration = calibrate(Hardware(), args.kernel_csv)
  os.makedirs(args.out, exist_ok=True)
  if args.scaling:
    return write_scaling(hw, calibration, args.out)
  probes = [path for path in args.probe_csv if os.path.exists(path)]
  compiled = load_probe(probes, hw)
  dflash = dflash_project(h100(hw), SCENARIOS["default"])
  dflash2 = dflash2_project(h100(hw), SCENARIOS["default"])
  dflash2_seed = dflash2_seed_project(h100(hw), SCENARIOS["default"])
  root = os.path.dirname(os.path.dirname(RESULTS_DIR))
  probe = ", ".join(f"`{os.path.relpath(path, root)}`" for path in probes) or "no probe CSV"
  offload = offload_on_both_links(hw, compiled)
  gdn = hybrid_rows(hw)
  text, rows = report(hw, calibration, compiled, probe, dflash, offload, dflash2, gdn,
                      dflash2_seed)
  print(text)
  write_csv(gdn, os.path.join(args.out, "cost_model_gdn.csv"))
  write_csv(dflash, os.path.join(args.out, "cost_model_dflash.csv"))
  write_csv(dflash2 + dflash2_seed, os.path.join(args.out, "cost_model_dflash2.csv"))
  write_csv(offload, os.path.join(args.out, "cost_model_offload.csv"))
  with open(os.path.join(args.out, "cost_model.md"), "w") as f:
    f.write(text)
  write_csv(rows, os.path.join(args.out, "cost_model.csv"))
  write_results_pages(args.out)


def write_scaling(hw, calibration: str, out: str, gpus=SCALING_GPUS, **projection) -> None:
  """cost_model_scaling.{md,csv,png}: the strong-scaling sweep on `hw`'s GPUs and links
  (`projection`: `scaling_rows`' models, lengths, block size, strategies)."""
  rows = scaling_rows([mesh_hardware(g, hw) for g in gpus], **projection)
  text = scaling_report(rows) + f"\n{calibration}.\n"
  print(text)
  with open(os.path.join(out, "cost_model_scaling.md"), "w") as f:
    f.write(text)
  write_csv(rows, os.path.join(out, "cost_model_scaling.csv"))
  plot_scaling(rows, os.path.join(out, "cost_model_scaling.png"))
  write_results_pages(out)


def plot_scaling(rows: list[dict], path: str) -> None:
  """Step time against GPUs, one panel per (L, model): each strategy's step (solid) and its
  exposed attention communication (dotted)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  seq_lens = sorted({r["seq_len"] for r in rows})
  models = list(dict.fromkeys(r["model"] for r in rows))
  gpus = sorted({r["gpus"] for r in rows})
  fig, axes = plt.subplots(len(seq_lens), len(models), squeeze=False,
                           figsize=(4.5 * len(models), 3.6 * len(seq_lens)))
  for ax_row, seq_len in zip(axes, seq_lens):
    for ax, model in zip(ax_row, models):
      for i, name in enumerate(STRATEGIES):  # those that fit somewhere in the panel
        mine = sorted((r for r in rows if (r["model"], r["seq_len"], r["strategy"])
                       == (model, seq_len, name)), key=lambda r: r["gpus"])
        if not any(r["fits"] for r in mine):
          continue
        x = [r["gpus"] for r in mine]
        ax.plot(x, [r["total_s"] for r in mine], "o-", color=f"C{i}", label=name)
        ax.plot(x, [r["attention_comm_s"] for r in mine], ":", color=f"C{i}")
      ax.set(xscale="log", yscale="log", xlabel="GPUs (8 a node)", ylabel="s / step",
             title=f"{model}, L = {seq_len // 1024}K")
      ax.set_xticks(gpus, [str(g) for g in gpus])
      ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
      ax.legend(fontsize=6, title="solid: step, dotted: exposed comm", title_fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
