"""Parallel decoding's trade-off on the quickstart's converted model: held-out arithmetic
accuracy against tokens per denoising forward, fixed steps per block beside confidence
thresholds (`sample.threshold`) and Fast-dLLM's factor rule (`sample.factor`).

  python run.py --config configs/quickstart.py --workdir runs/quickstart   # train it first
  python experiments/decode_tradeoff.py --workdirs runs/quickstart --seeds 0

Each trained run (`--workdirs`, one per seed in `--seeds`, trained with `--set seed=S`) is
restored once; every decoding then completes the same `--prompts` held-out prompts greedily
through `sample_batch` (the eval's own path, evaluate.arithmetic_accuracy), and the table
gives accuracy, measured chance, tokens per denoising forward (cache commits counted apart)
and the wall time, mean over the runs. Writes decode_tradeoff.{csv,md,png} under --out.
"""

import argparse
import csv
import os
import statistics
import time

from bdlm_jax.checkpoint import restore_state
from bdlm_jax.configure import load_config, replace
from bdlm_jax.evaluate import arithmetic_accuracy, arithmetic_prompts
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.sample import SampleStats, sampling_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
FIELDS = ["seed", "decoding", "steps_per_block", "threshold", "factor", "prompts", "accuracy",
          "chance", "tokens_per_forward", "seconds"]
RULES = (("fixed steps per block", "o-"), ("threshold", "s--"), ("factor", "^:"))


def decodings(args) -> list[tuple[str, int, float, float]]:
  """(name, steps_per_block, threshold, factor): the fixed schedules, then each threshold and
  each factor over one token a step (so at least the most confident token each step)."""
  fixed = [(f"fixed, {'one token a step' if s == 0 else f'{s} steps a block'}", s, 0.0, 0.0)
           for s in args.steps]
  return (fixed + [(f"threshold {t:g}", 0, t, 0.0) for t in args.thresholds]
          + [(f"factor {f:g}", 0, 0.0, f) for f in args.factors])


def rule(row: dict) -> str:
  return ("threshold" if float(row["threshold"]) else "factor" if float(row["factor"]) else
          "fixed steps per block")


def measure(workdir: str, seed: int, args) -> list[dict]:
  cfg = load_config(args.config, [f"seed={seed}"])
  _, state = restore_state(cfg, workdir, make_mesh(cfg))
  params = sampling_params(state.params)
  prompts = arithmetic_prompts(cfg, args.prompts)
  rows = []
  for name, steps, threshold, factor in decodings(args):
    stats = SampleStats()
    began = time.perf_counter()
    options = dict(steps_per_block=steps, threshold=threshold, factor=factor)
    accuracy, chance, _ = arithmetic_accuracy(params, replace(cfg, sample=options), prompts,
                                              stats=stats)
    rows.append(dict(seed=seed, decoding=name, **options, prompts=len(prompts),
                     accuracy=accuracy, chance=chance,
                     tokens_per_forward=stats.tokens_per_forward,
                     seconds=time.perf_counter() - began))
    print(f"seed {seed}, {name}: accuracy {accuracy:.1%} (chance {chance:.1%}), "
          f"{stats.tokens_per_forward:.2f} tokens per forward, {rows[-1]['seconds']:.0f} s",
          flush=True)
  return rows


def _mean(rows, key) -> float:
  return statistics.mean(float(r[key]) for r in rows)


def _grouped(rows: list[dict]) -> dict[str, list[dict]]:
  groups = {}
  for r in rows:
    groups.setdefault(r["decoding"], []).append(r)
  return groups


def table(rows: list[dict], config: str) -> str:
  seeds = sorted({int(r["seed"]) for r in rows})
  lines = ["## Parallel decoding: accuracy against tokens per forward", "",
           f"`python experiments/decode_tradeoff.py`: {config}'s converted model, seeds "
           f"{seeds} (mean over them), {rows[0]['prompts']} held-out prompts completed "
           f"greedily by sample_batch. Tokens per forward: tokens revealed per denoising "
           f"forward (the KV-cache commit of each finished block is a forward of its own, not "
           f"counted). Wall time on the machine that ran it; the first decoding's includes the "
           f"sampler's compiles, which the others reuse (the options are traced).", "",
           "| decoding | accuracy | chance | tokens per forward | wall s |",
           "|---|---|---|---|---|"]
  for name, rs in _grouped(rows).items():
    lines.append(f"| {name} | {_mean(rs, 'accuracy'):.1%} | {_mean(rs, 'chance'):.1%} | "
                 f"{_mean(rs, 'tokens_per_forward'):.2f} | {_mean(rs, 'seconds'):.0f} |")
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  groups = _grouped(rows)
  for label, style in RULES:
    points = sorted((_mean(rs, "tokens_per_forward"), 100 * _mean(rs, "accuracy"))
                    for rs in groups.values() if rule(rs[0]) == label)
    if points:
      ax.plot(*zip(*points), style, label=label)
  ax.set_xlabel("tokens per denoising forward")
  ax.set_ylabel("held-out accuracy (%)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdirs", nargs="+", required=True)
  parser.add_argument("--seeds", type=int, nargs="+", required=True,
                      help="the seed each workdir was trained with, in order")
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart.py"))
  parser.add_argument("--prompts", type=int, default=512)
  parser.add_argument("--steps", type=int, nargs="+", default=[0, 2, 1],
                      help="fixed sample.steps_per_block values (0: one token a step)")
  parser.add_argument("--thresholds", type=float, nargs="*", default=[0.9, 0.7, 0.5, 0.3, 0.2, 0.1])
  parser.add_argument("--factors", type=float, nargs="*", default=[0.5, 1.0, 2.0, 4.0, 8.0])
  parser.add_argument("--out", default=RESULTS_DIR)
  args = parser.parse_args(argv)
  if len(args.workdirs) != len(args.seeds):
    parser.error(f"{len(args.workdirs)} workdirs but {len(args.seeds)} seeds: one seed each")
  rows = [row for workdir, seed in zip(args.workdirs, args.seeds)
          for row in measure(workdir, seed, args)]
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, "decode_tradeoff")
  with open(base + ".csv", "w", newline="") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    writer.writerows(rows)
  with open(base + ".md", "w") as f:
    f.write(table(rows, os.path.relpath(args.config, ROOT)))
  plot(rows, base + ".png")
  print(f"wrote {base}.csv, .md and .png")


if __name__ == "__main__":
  main()
