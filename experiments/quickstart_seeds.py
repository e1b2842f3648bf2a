"""The README's quickstart command, run as a user runs it, once per seed: what it prints and
how long it takes.

  python experiments/quickstart_seeds.py               # seeds 0, 1, 2 (~5 minutes each)
  python experiments/quickstart_seeds.py --config configs/quickstart_bd3lm.py
                                                       # the BD3-LM from scratch, the same way
  python experiments/quickstart_seeds.py --seeds 3     # another seed, merged into the table

Each run is `python run.py --config <config> --set seed=S` in a fresh workdir (a subprocess,
timed from start to exit), and what it prints last is recorded: the final model's
(for configs/quickstart.py the converted block-diffusion model, decoded block by block)
arithmetic accuracy next to chance and held-out loss, those of its first stage where it has
one (the pretrained AR model), and the sample. Writes quickstart_seeds.{csv,md} under --out
(rows of other configs and seeds kept); the README and docs/evaluate.md quote them.
"""

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bdlm_jax.analysis.results import produced, write_results_pages


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
FIELDS = ("config", "seed", "wall_s", "first_loss", "first_accuracy", "first_chance", "loss",
          "accuracy", "chance", "sample", "printed", "produced")
HELD_OUT = re.compile(r"held-out .*? (\d+\.\d+) nats/token.*?accuracy (\d+\.\d+)% "
                      r"\(chance (\d+\.\d+)%\)")


def run_seed(config: str, seed: int, workdir: str, overrides=()) -> dict:
  """One run (with `overrides`, run.py's --set syntax): its wall time and what it printed."""
  start = time.perf_counter()
  sets = [x for item in (f"seed={seed}", *overrides) for x in ("--set", item)]
  done = subprocess.run([sys.executable, "run.py", "--config", config, *sets, "--workdir",
                         workdir, "--no-progress"], cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if done.returncode:
    raise RuntimeError(f"{config} seed {seed}: exit {done.returncode}\n{done.stderr[-2000:]}")
  lines = done.stdout.splitlines()
  first = [HELD_OUT.search(x).groups() for x in lines if x.startswith("stage 1")]
  final = [HELD_OUT.search(x).groups() for x in lines if x.startswith("held-out")][-1]
  return dict(config=config, seed=seed, wall_s=round(wall, 1),
              **dict(zip(("first_loss", "first_accuracy", "first_chance"),
                         first[0] if first else ("", "", ""))),
              loss=final[0], accuracy=final[1], chance=final[2],
              sample=next(x for x in lines if x.startswith("sample:")),
              printed="\n".join(lines[next(i for i, x in enumerate(lines)
                                            if x.startswith("trained")):]))


def _mean_sd(rows: list[dict], key: str) -> str:
  values = [float(r[key]) for r in rows]
  return (f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}" if len(values) > 1
          else f"{values[0]:.1f}")


def markdown(rows: list[dict]) -> str:
  lines = ["## The quickstart, seed by seed", "",
           "`python run.py --config <config> --set seed=S`, each in a fresh workdir, timed from "
           "start to exit on the machine the provenance line names. configs/quickstart.py: "
           "stage 1 pretrains `ar`, stage 2 converts it by fast_dllm_v2 and decodes block by "
           "block; configs/quickstart_bd3lm.py trains a BD3-LM from scratch. Accuracy: greedy "
           "completions of 512 held-out '... a+b=' prompts; chance: the same completions "
           "scored against the other prompts' answers. Loss: held-out NLL (ar), Fast-dLLM v2's "
           "own loss, or the NELBO (bd3lm), nats/token.", ""]
  for config in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == config]
    staged = any(r["first_accuracy"] for r in mine)
    lines += [f"### {config}", "", "| seed | wall s | " + (
        "stage 1 (ar) loss | stage 1 accuracy (chance) | " if staged else "") +
        "loss | accuracy (chance) |", "|---|---|" + "---|---|" * (2 if staged else 1)]
    for r in mine:
      first = (f"{r['first_loss']} | {r['first_accuracy']}% ({r['first_chance']}%) | "
               if staged else "")
      lines.append(f"| {r['seed']} | {float(r['wall_s']):.0f} | {first}{r['loss']} | "
                   f"{r['accuracy']}% ({r['chance']}%) |")
    lines.append(f"| mean ± sd | {_mean_sd(mine, 'wall_s')} | " + (
        f"| {_mean_sd(mine, 'first_accuracy')}% | " if staged else "") +
        f"| {_mean_sd(mine, 'accuracy')}% |")
    lines += ["", "Samples:", "", *(f"* seed {r['seed']}: {r['sample']}" for r in mine), ""]
    printed = next((r for r in mine if r.get("printed")), None)
    if printed:
      lines += [f"What seed {printed['seed']} printed last:", "", "```text",
                printed["printed"], "```", ""]
    lines += [*dict.fromkeys(r["produced"] for r in mine), ""]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/quickstart.py")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--out", default=RESULTS_DIR)
  args = parser.parse_args(argv)
  provenance = produced("python experiments/quickstart_seeds.py " + " ".join(
      argv if argv is not None else sys.argv[1:]))
  path = os.path.join(args.out, "quickstart_seeds.csv")
  rows = {}
  if os.path.exists(path):
    with open(path) as f:
      rows = {(r["config"], int(r["seed"])): r for r in csv.DictReader(f)}
  with tempfile.TemporaryDirectory() as scratch:
    for seed in args.seeds:
      rows[args.config, seed] = dict(run_seed(args.config, seed, os.path.join(scratch, str(seed))),
                                     produced=provenance)
      print(rows[args.config, seed], flush=True)
  rows = [rows[k] for k in sorted(rows)]
  os.makedirs(args.out, exist_ok=True)
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(args.out, "quickstart_seeds.md"), "w") as f:
    f.write(markdown(rows))
  write_results_pages(args.out)


if __name__ == "__main__":
  main()
