"""Fast-dLLM v2 as the seed trains it vs ours: which converts the quickstart's AR model better.

  python experiments/conversion_forms.py            # 3 seeds x (ar + 2 conversions), ~40 min on 2 CPU cores
  python experiments/conversion_forms.py --tiny     # smoke run, < 2 min

Per seed: configs/quickstart_bd3lm.py's model pretrained with `ar`, exported to a Hugging Face
folder, then converted by fast_dllm_v2 from that folder in each form, with the same steps,
batches and learning rate:
* ours: a block's first token scored on the clean row the sampler reads, the [MASK] logit
  removed (SUBS), t antithetic over the batch's blocks;
* seed: `objective.boundary_row=noisy keep_mask_logit=true antithetic=false` (Turbo-dLLM
  0.1.6's Fast-dLLM v2: labels on the noisy copies, the [MASK] logit kept, t independent).
Each converted model is scored on the held-out split under *both* forms' losses (the same
fixed batches and noise keys; neither is a likelihood bound) and by the arithmetic accuracy
of its block-by-block greedy completions against measured chance. Writes
conversion_forms.{csv,md} under --out.
"""

import argparse
import csv
import os
import statistics
import subprocess
import tempfile

from bdlm_jax.analysis.results import write_results_pages
from bdlm_jax.checkpoint.hf_export import export_checkpoint
from bdlm_jax.configure import load_config
from bdlm_jax.evaluate import evaluate_checkpoint
from bdlm_jax.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart_bd3lm.py")
FORMS = {"ours": ["objective.boundary_row=clean", "objective.keep_mask_logit=false",
                  "objective.antithetic=true"],
         "seed": ["objective.boundary_row=noisy", "objective.keep_mask_logit=true",
                  "objective.antithetic=false"]}
FIELDS = ["seed", "model", "steps", "eval_accuracy", "eval_chance", "loss_ours", "loss_seed",
          "train_loss", "commit"]


def _common(args, seed: int, steps: int) -> list[str]:
  return [f"seed={seed}", f"train.steps={steps}", f"train.eval_every={steps}",
          f"train.log_every={steps}", f"train.ckpt_every={steps}", f"eval.prompts={args.prompts}",
          f"train.batch_size={args.batch_size}"]


def held_out_losses(cfg_overrides: list[str], workdir: str) -> dict:
  """The converted model's held-out loss under each form (no sampling)."""
  out = {}
  for form, extra in FORMS.items():
    cfg = load_config(QUICKSTART, cfg_overrides + extra + ["eval.prompts=0"])
    out[f"loss_{form}"] = evaluate_checkpoint(cfg, workdir)[1]["eval_loss"]
  return out


def run_seed(seed: int, args, scratch: str) -> list[dict]:
  ar_dir = os.path.join(scratch, f"ar_{seed}")
  ar_over = ["objective.name=ar"] + _common(args, seed, args.ar_steps)
  last = train(load_config(QUICKSTART, ar_over), ar_dir, progress=False)[-1]
  rows = [dict(seed=seed, model="ar", steps=args.ar_steps, eval_accuracy=last["eval_accuracy"],
               eval_chance=last["eval_chance"], train_loss=last["loss"])]
  hf_dir = os.path.join(scratch, f"ar_{seed}_hf")
  export_checkpoint(load_config(QUICKSTART, ar_over + [f"export.out_dir={hf_dir}"]), ar_dir)
  for form, extra in FORMS.items():
    over = ["objective.name=fast_dllm_v2", f"init_from={hf_dir}", f"train.lr={args.lr}",
            *_common(args, seed, args.steps), *extra]
    workdir = os.path.join(scratch, f"{form}_{seed}")
    last = train(load_config(QUICKSTART, over), workdir, progress=False)[-1]
    rows.append(dict(seed=seed, model=form, steps=args.steps, train_loss=last["loss"],
                     eval_accuracy=last["eval_accuracy"], eval_chance=last["eval_chance"],
                     **held_out_losses(over, workdir)))
  return rows


def _mean_sd(values, fmt="{:.3f}") -> str:
  values = [v for v in values if v not in (None, "")]
  if not values:
    return "-"
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{fmt.format(statistics.mean(values))} ± {fmt.format(sd)}"


def table(rows: list[dict], args, command: str, commit: str) -> str:
  seeds = sorted({r["seed"] for r in rows})
  lines = [
      "## AR -> BDLM conversion: Fast-dLLM v2 as the seed trains it vs ours", "",
      f"`{command}` (commit {commit}): configs/quickstart_bd3lm.py's model, `ar` for "
      f"{args.ar_steps} steps, exported, then fast_dllm_v2 from that folder for {args.steps} "
      f"steps at lr {args.lr} in each form; {args.batch_size} sequences a step, seeds {seeds}. "
      f"Accuracy: greedy completions of {args.prompts} held-out '... a+b=' prompts (block by "
      f"block for the converted models); chance: the same completions scored against other "
      f"prompts' answers. Held-out losses: the same fixed batches and noise keys, scored "
      f"under our form's loss and the seed's.", "",
      "| model | accuracy per seed | accuracy (mean ± sd) | chance | held-out loss, ours | "
      "held-out loss, seed's |",
      "|---|---|---|---|---|---|"]
  for model in ("ar", *FORMS):
    rs = [r for r in rows if r["model"] == model]
    per_seed = ", ".join(f"{r['eval_accuracy']:.1%}" for r in rs)
    acc = [r["eval_accuracy"] * 100 for r in rs]
    lines.append(f"| {model} | {per_seed} | {_mean_sd(acc, '{:.1f}')}% | "
                 f"{_mean_sd([r['eval_chance'] * 100 for r in rs], '{:.1f}')}% | "
                 f"{_mean_sd([r.get('loss_ours') for r in rs])} | "
                 f"{_mean_sd([r.get('loss_seed') for r in rs])} |")
  return "\n".join(lines + ["", verdict(rows)] + ([
      "", "(-dirty: the run's working tree held changes not yet committed; the next commit "
      "holds them.)"] if commit.endswith("-dirty") else [])) + "\n"


def verdict(rows: list[dict]) -> str:
  """Which form converts better, seed by seed (the same AR model under both)."""
  acc = {(r["seed"], r["model"]): r["eval_accuracy"] for r in rows}
  seeds = sorted({r["seed"] for r in rows})
  gaps = [100 * (acc[(s, "ours")] - acc[(s, "seed")]) for s in seeds]
  better = sum(g > 0 for g in gaps)
  return (f"Ours minus the seed's form, accuracy points per seed: "
          f"{', '.join(f'{g:+.1f}' for g in gaps)}; ours is higher on {better} of "
          f"{len(seeds)} seeds.")


def _parse(row: dict) -> dict:
  return {k: (v if k in ("model", "commit") else float(v) if v else None)
          for k, v in row.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--ar-steps", type=int, default=600)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--prompts", type=int, default=256)
  parser.add_argument("--tiny", action="store_true", help="smoke run: one seed, a few steps")
  parser.add_argument("--replot", action="store_true",
                      help="no training: rewrite the table from --out's CSV")
  args = parser.parse_args(argv)
  if args.tiny:
    args.seeds, args.ar_steps, args.steps, args.batch_size, args.prompts = [0], 4, 4, 4, 4
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "conversion_forms.csv")
  if args.replot:
    rows = [_parse(r) for r in csv.DictReader(open(path))]
  else:
    rows = []
    # The code that ran: "-dirty" where the working tree had changes not yet committed
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory() as scratch:
      for seed in args.seeds:
        rows += [dict(r, commit=commit) for r in run_seed(seed, args, scratch)]
        print(rows[-3:], flush=True)
    with open(path, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=FIELDS)
      writer.writeheader()
      writer.writerows(rows)
  command = "python experiments/conversion_forms.py" + (" --tiny" if args.tiny else "")
  text = table(rows, args, command, ", ".join(sorted({r["commit"] for r in rows})))
  with open(os.path.join(args.out, "conversion_forms.md"), "w") as f:
    f.write(text)
  write_results_pages(args.out)
  print(text)


if __name__ == "__main__":
  main()
