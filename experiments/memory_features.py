"""What each memory feature buys at the long-context recipes: their train step compiled (never
run) with the features turned on one after another, per device, on a target's compiler.

  python experiments/memory_features.py                      # XLA:TPU, 16 / 8 TPU v5p chips
  python experiments/memory_features.py --target cpu         # XLA:CPU, simulated devices
  python experiments/memory_features.py --recipes llama3-8b-1m-16 --strategies csbp_ring

Recipes (RECIPES): configs/llama3_8b_bdlm_1m.py on 16 devices and, with parallel.seq=8, on 8,
and configs/gemma3_27b_bdlm_256k.py on 16. Steps (STEPS), each adding one feature to the one
before: remat=full and whole rows (the layer's saved residuals on the device, its row-wise work
over all of a device's rows at once), then the saved residuals in host memory
(model.remat=offload), then row chunks (the recipe's model.row_chunks), then, where host memory
runs out (8 devices at 1M), only the layer input in host memory (model.remat=offload_input).
Attention always runs in its tiles (kernels/xla.py). Every compile runs in its own process
(bdlm_jax.analysis.isolated); one that does not fit is a row with the compiler's refusal.

Per device: *peak*, the compiler's own where it reports one (XLA:TPU), else the every-buffer
bound (XLA:CPU), and with buffers in host memory the smaller of the two (XLA:TPU's peak then
counts the host's: docs/measuring.md); *device peak*, the device's high-water mark read from
the compiler's buffer assignment (bdlm_jax.analysis.buffer_assignment, which every compile
dumps). Writes memory_features[_cpu].{csv,md} under --out; a run replaces the rows it
measures.
"""

import argparse
import csv
import json
import os
import sys

from bdlm_jax.analysis import isolated, step_report, targets
from bdlm_jax.configure import load_config
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.registry import get_strategy, strategy_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
GB = 1e9
# name: (config file, overrides, its TPU topology, the per-device budget it must meet in GB,
# its steps: indices into STEPS)
RECIPES = {
    "llama3-8b-1m-16": ("configs/llama3_8b_bdlm_1m.py", (), "tpu:v5p:2x2x4", 48, (0, 1, 2)),
    "llama3-8b-1m-8": ("configs/llama3_8b_bdlm_1m.py", ("parallel.seq=8",), "tpu:v5p:2x2x2", 80,
                       (2, 3)),
    "gemma3-27b-256k-16": ("configs/gemma3_27b_bdlm_256k.py", (), "tpu:v5p:2x2x4", 64,
                           (0, 1, 2)),
}
STEPS = (  # (what is on, overrides); model.row_chunks unset keeps the recipe's
    ("remat=full, whole rows", ("model.remat=full", "model.row_chunks=1")),
    ("+ residuals in host memory (remat=offload)", ("model.remat=offload", "model.row_chunks=1")),
    ("+ row chunks (the recipe's model.row_chunks)", ("model.remat=offload",)),
    ("+ only the layer input in host memory (remat=offload_input)",
     ("model.remat=offload_input",)),
)
FIELDS = ("recipe", "step", "strategy", "target", "devices", "peak_bytes", "device_peak_bytes",
          "compiler_peak_bytes", "bound_bytes", "temp_bytes", "argument_bytes", "host_bytes",
          "compile_s", "error")


def default_strategies(recipe: str) -> list[str]:
  """The recipe's own strategy and the first published baseline with the same transport."""
  own = get_strategy(load_config(os.path.join(ROOT, RECIPES[recipe][0])).parallel.strategy)
  return [own.name, strategy_names(baseline=True, transport=own.transport)[0]]


def job_config(job: dict):
  path, overrides, *_ = RECIPES[job["recipe"]]
  return load_config(os.path.join(ROOT, path), (*overrides, *job["overrides"],
                                                 f"parallel.strategy={job['strategy']}"))


def _worker(job: dict) -> None:
  try:
    cfg = job_config(job)
    mesh = make_mesh(cfg, targets.resolve(job["target"], cfg.parallel.seq).devices)
    report = step_report.step_report(cfg, mesh)
    row = dict(report.row(), device_peak_bytes=report.device_live_bytes)
  except ConfigError as e:
    row = dict(error=str(e))
  except Exception as e:  # noqa: BLE001 (a step that does not fit is a finding)
    row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
  print(json.dumps(row))


def measure(job: dict, timeout_s: float) -> dict:
  devices = job_config(job).parallel.seq
  row = isolated.run_worker(__file__, job, devices, job["target"], timeout_s)
  return dict(recipe=job["recipe"], step=job["step"], strategy=job["strategy"],
              target=job["target"], devices=devices,
              **{k: row.get(k, "") for k in FIELDS[5:]})


def _gb(row: dict, key: str) -> str:
  return "" if row.get(key) in ("", None) else f"{float(row[key]) / GB:.2f}"


def markdown(rows: list[dict], compiler: str) -> str:
  lines = [f"## Memory features at the long-context recipes ({compiler}, per device)", "",
           "Each step adds one feature to the one above. *bound* = arguments + temp + output - "
           "alias: every device buffer live at once (host ones reported apart); *compiler's "
           "peak*: XLA:TPU's peak_memory_in_bytes, which counts host-resident buffers too "
           "(docs/measuring.md); *peak*: the compiler's where nothing is in host memory, else the "
           "smaller of the two; *device peak*: the device's high-water mark from the compiler's "
           "buffer assignment, where measured; *host*: what the step keeps in "
           "host memory (the offloaded residuals). Produced by `python "
           "experiments/memory_features.py` (see its docstring).", ""]
  for recipe, (path, overrides, _, budget, _) in RECIPES.items():
    mine = [r for r in rows if r["recipe"] == recipe]
    if not mine:
      continue
    lines += [f"### {recipe}: `{path}`{''.join(' --set ' + o for o in overrides)} "
              f"(target <= {budget} GB)", "",
              "| step | strategy | devices | peak GB | device peak GB | compiler's peak GB | "
              f"bound GB | temp GB | host GB | peak <= {budget} GB |", "|" + "---|" * 10]
    for r in mine:
      if r.get("error"):
        lines.append(f"| {r['step']} | {r['strategy']} | {r['devices']} | "
                     f"{r['error'][:160]} | | | | | | no |")
        continue
      fits = "yes" if float(r["peak_bytes"]) <= budget * GB else "no"
      lines.append(f"| {r['step']} | {r['strategy']} | {r['devices']} | {_gb(r, 'peak_bytes')} "
                   f"| {_gb(r, 'device_peak_bytes') or '—'} | {_gb(r, 'compiler_peak_bytes')} | "
                   f"{_gb(r, 'bound_bytes')} | {_gb(r, 'temp_bytes')} | {_gb(r, 'host_bytes')} | "
                   f"{fits} |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
  parser.add_argument("--strategies", nargs="+",
                      help="default: the recipe's own, then the first published baseline "
                           "with its transport (csbp_ring, then cp_ring)")
  parser.add_argument("--steps", nargs="+", type=int,
                      help="indices into STEPS (default: the recipe's own); the other "
                           "strategies run the last one only")
  parser.add_argument("--target", default="tpu",
                      help="tpu (each recipe's TPU topology) or cpu (simulated devices)")
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return _worker(json.loads(args.worker))
  rows = []
  for recipe in args.recipes:
    target = RECIPES[recipe][2] if args.target == "tpu" else args.target
    steps = args.steps or RECIPES[recipe][4]
    for i, strategy in enumerate(args.strategies or default_strategies(recipe)):
      for s in steps if i == 0 else steps[-1:]:
        label, overrides = STEPS[s]
        job = dict(recipe=recipe, step=label, strategy=strategy, target=target,
                   overrides=list(overrides))
        rows.append(measure(job, args.timeout))
        r = rows[-1]
        print(f"{recipe} | {label} | {strategy}: "
              + (r["error"] or f"peak {_gb(r, 'peak_bytes')} GB, host {_gb(r, 'host_bytes')} GB"),
              flush=True)
  name = os.path.join(args.out, "memory_features" + ("" if args.target == "tpu" else "_cpu"))
  key = lambda r: (r["recipe"], r["step"], r["strategy"])
  earlier = []
  if os.path.exists(f"{name}.csv"):
    with open(f"{name}.csv") as f:
      earlier = [dict.fromkeys(FIELDS, "") | r for r in csv.DictReader(f)]
  fresh = {key(r) for r in rows}
  merged = [r for r in earlier if key(r) not in fresh] + rows
  order = {k: i for i, k in enumerate(RECIPES)}
  merged.sort(key=lambda r: (order[r["recipe"]], [s for s, _ in STEPS].index(r["step"]),
                             r["strategy"] != default_strategies(r["recipe"])[0]))
  os.makedirs(args.out, exist_ok=True)
  with open(f"{name}.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    writer.writerows(merged)
  compiler = "XLA:TPU ahead of time, TPU v5p" if args.target == "tpu" else "XLA:CPU"
  with open(f"{name}.md", "w") as f:
    f.write(markdown(merged, compiler))
  print(f"wrote {name}.csv and {name}.md")


if __name__ == "__main__":
  sys.exit(main())
