"""The block-size trade-off on the embedded data: held-out NLL (ar) vs NELBO (bd3lm, per B).

  python experiments/block_size_sweep.py            # 3 seeds x (ar + 3 block sizes), ~25 min on 2 CPU cores
  python experiments/block_size_sweep.py --tiny     # smoke run, < 1 min

Every run trains configs/quickstart_bd3lm.py's model (BD3-LM's 1/t weights, t over [1e-3, 1],
whatever the quickstart trains with) for the same number of steps on the same
batches (one token budget: steps x batch x L data tokens), then evaluates the held-out split
(evaluate.py: fixed batches, NELBO over `eval.noise_draws` fixed draws with t over
[eval.t_min, 1]; exact NLL for ar) and the arithmetic accuracy of greedy completions against
measured chance. BD3-LM reports that the bound tightens as blocks shrink toward AR (B = 1
is AR); the table says whether ours does at this budget, with the spread over seeds. Writes
block_size_sweep.{csv,md,png} under --out and refreshes the results pages (docs/results/).
"""

import argparse
import csv
import math
import os
import statistics
import tempfile

from bdlm_jax.analysis.results import write_results_pages
from bdlm_jax.config import EvalConfig
from bdlm_jax.configure import load_config
from bdlm_jax.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
FIELDS = ["objective", "block_size", "seed", "steps", "tokens", "eval_loss", "eval_accuracy",
          "eval_chance", "train_loss"]


def run_one(objective: str, block_size: int, seed: int, args) -> dict:
  overrides = [f"objective.name={objective}", f"objective.block_size={block_size}",
               "objective.loss_weight=inv_t", "objective.eps_min=0.001", "objective.eps_max=1.0",
               f"data.seq_len={args.seq_len}", f"train.batch_size={args.batch_size}",
               f"train.steps={args.steps}", f"train.eval_every={args.steps}",
               f"train.log_every={args.steps}", f"train.ckpt_every={args.steps}",
               f"eval.prompts={args.prompts}", f"seed={seed}"]
  cfg = load_config(os.path.join(ROOT, "configs", "quickstart_bd3lm.py"), overrides)
  with tempfile.TemporaryDirectory() as workdir:
    last = train(cfg, workdir, progress=False)[-1]
  return dict(objective=objective, block_size=block_size if objective != "ar" else 1,
              seed=seed, steps=args.steps, tokens=args.steps * args.batch_size * args.seq_len,
              eval_loss=last["eval_loss"], eval_accuracy=last.get("eval_accuracy"),
              eval_chance=last.get("eval_chance"), train_loss=last["loss"])


def _parse(row: dict) -> dict:
  number = {k: float(v) if v else None for k, v in row.items() if k != "objective"}
  return dict(number, objective=row["objective"], block_size=int(row["block_size"]))


def _mean_sd(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(rows: list[dict], args) -> str:
  e = EvalConfig()
  groups = {}
  for r in rows:
    groups.setdefault((r["objective"], r["block_size"]), []).append(r)
  lines = ["## Block size: held-out NLL / NELBO on the embedded data", "",
           f"`python experiments/block_size_sweep.py`: configs/quickstart_bd3lm.py's model, "
           f"L = {args.seq_len}, {args.batch_size} sequences x {args.steps} steps "
           f"({args.steps * args.batch_size * args.seq_len:,} data tokens) per run, "
           f"seeds {args.seeds} (mean ± sd over seeds). Held-out: {e.batches} fixed batches; "
           f"bd3lm's NELBO averages {e.noise_draws} fixed noise draws, t over [{e.t_min}, 1]. "
           f"ar is B = 1 (exact NLL). Accuracy: greedy completion of {args.prompts} held-out "
           f"'... a+b=' prompts; chance: the same completions scored against other prompts' "
           f"answers.", "",
           "| objective | B | held-out nats/token | exp(mean): perplexity (bound) | accuracy | "
           "chance |",
           "|---|---|---|---|---|---|"]
  for (objective, b), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "ar", kv[0][1])):
    losses = [r["eval_loss"] for r in rs]
    ppl = math.exp(statistics.mean(losses))
    lines.append(f"| {objective} | {b} | {_mean_sd(losses)} | {ppl:.2f} | "
                 f"{_mean_sd([r['eval_accuracy'] for r in rs])} | "
                 f"{_mean_sd([r['eval_chance'] for r in rs])} |")
  return "\n".join(lines + ["", verdict(groups)]) + "\n"


def verdict(groups: dict) -> str:
  """Does the held-out loss fall as B shrinks toward AR? Neighbours in B whose means differ by
  less than the larger spread over seeds are called unresolved, not ordered."""
  order = sorted(groups, key=lambda key: (key[0] != "ar", key[1]))
  stats = [(f"B={b}" if o != "ar" else "ar", [r["eval_loss"] for r in groups[(o, b)]])
           for o, b in order]
  parts = []
  for (name_a, a), (name_b, b) in zip(stats, stats[1:]):
    gap = statistics.mean(b) - statistics.mean(a)
    spread = max(statistics.stdev(x) if len(x) > 1 else 0.0 for x in (a, b))
    if abs(gap) <= spread:
      parts.append(f"{name_a} vs {name_b}: unresolved ({gap:+.3f}, seed sd {spread:.3f})")
    else:
      parts.append(f"{name_a} {'<' if gap > 0 else '>'} {name_b} ({gap:+.3f}, seed sd "
                   f"{spread:.3f})")
  return "Tighter toward AR? " + "; ".join(parts) + "."


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  bd = sorted({r["block_size"] for r in rows if r["objective"] == "bd3lm"})
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for r in rows:
    if r["objective"] == "bd3lm":
      ax.plot(r["block_size"], r["eval_loss"], "o", color="C0", alpha=0.5)
  ax.plot(bd, [statistics.mean(r["eval_loss"] for r in rows
                               if r["objective"] == "bd3lm" and r["block_size"] == b)
               for b in bd], "-", color="C0", label="bd3lm held-out NELBO")
  ar = [r["eval_loss"] for r in rows if r["objective"] == "ar"]
  if ar:
    ax.axhline(statistics.mean(ar), color="C1", ls="--", label="ar held-out NLL (B = 1)")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("block size B")
  ax.set_ylabel("nats / token")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 16, 64])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--tiny", action="store_true", help="smoke run: 2 block sizes, 3 steps")
  parser.add_argument("--replot", action="store_true",
                      help="no training: rewrite the table and plot from --out's CSV (pass the "
                           "options it was run with)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.block_sizes, args.seeds, args.seq_len, args.batch_size, args.steps, args.prompts = (
        [4, 16], [0], 16, 4, 3, 4)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "block_size_sweep.csv")
  if args.replot:
    rows = [_parse(r) for r in csv.DictReader(open(path))]
  else:
    rows = []
    for seed in args.seeds:
      for objective, b in [("ar", args.block_sizes[0])] + [("bd3lm", b) for b in args.block_sizes]:
        rows.append(run_one(objective, b, seed, args))
        print({k: rows[-1][k] for k in ("objective", "block_size", "seed", "eval_loss",
                                         "eval_accuracy", "eval_chance")}, flush=True)
    with open(path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=FIELDS)
      writer.writeheader()
      writer.writerows(rows)
  text = table(rows, args)
  with open(os.path.join(args.out, "block_size_sweep.md"), "w") as f:
    f.write(text)
  plot(rows, os.path.join(args.out, "block_size_sweep.png"))
  write_results_pages(args.out)
  print(text)


if __name__ == "__main__":
  main()
