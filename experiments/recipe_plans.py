"""The shipped recipes compiled for their own target: per strategy and per variant, compile only.

  python experiments/recipe_plans.py --config configs/dflash2_muse_1m.py \
      --strategies csbp_ring cp_replicated_drafts \
      --variant "ours: parallel.seq=8 parallel.data=1 train.batch_size=1 model.param_dtype=float32 model.remat=full"
  python experiments/recipe_plans.py --config configs/dflash2_qwen3_8_27b_1m.py \
      --strategies csbp_ring cp_replicated_drafts

Each (config, variant, strategy) is the config file as it ships (variant `recipe`) or with a
variant's overrides (`--variant "name: KEY=VALUE ..."`, run.py's --set syntax), compiled with
the train step of `mode=plan` (`step_report`) for the config's own `plan.target` (XLA:TPU
ahead of time for a TPU recipe; needs libtpu) on as many devices as its mesh names, each in
a fresh process (`bdlm_jax.analysis.isolated`). Per device it records the arguments, temp,
the compiler's peak, the bound (every buffer live at once), host-resident bytes, the
device's own figures from XLA's buffer assignment (what it allocates in device memory, and
what of that is live at the step's peak: `bdlm_jax.analysis.buffer_assignment`; the
compiler's peak counts host-resident buffers too, where a step offloads), the attention bytes
the layout plan sends a step and compiled/plan, and whether the device's allocation fits the
target's device. Writes recipe_plans.{csv,md} under
--out; a run merges into what is there (the rows it measures replace theirs). The docs quote
these files, and their tests compare the quoted figures with them.
"""

import argparse
import csv
import json
import os
import sys

from bdlm_jax.analysis import isolated, step_report, targets
from bdlm_jax.analysis.results import produced, write_results_pages
from bdlm_jax.configure import load_config, override
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel.mesh import make_mesh


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
GB = step_report.GB
RECIPE = "recipe"  # the config file as it ships
KEYS = ("config", "variant", "strategy")
FIGURES = ("argument_bytes", "temp_bytes", "compiler_peak_bytes", "peak_bytes", "bound_bytes",
           "host_bytes", "device_allocated_bytes", "device_live_bytes", "attention_bytes",
           "attention_check", "compile_s", "dot_flops", "dot_flops_uncounted",
           "collective_total_bytes", "attention_collective_total_bytes", "recurrence_bytes",
           "weight_collective_total_bytes")
# the program's collective operand bytes a step (no compile), as each row's check compares
OPERANDS = ("expected_attention_operand_bytes", "expected_recurrence_operand_bytes")
COLUMNS = (*KEYS, "overrides", "target", "devices", "device_bytes", "fits", "error", *FIGURES,
           *OPERANDS, "command")


def job_config(job: dict):
  return override(load_config(os.path.join(ROOT, job["config"])),
                  (*job["overrides"], f"parallel.strategy={job['strategy']}"))


def devices(cfg) -> int:
  p = cfg.parallel
  return p.data * p.fsdp * p.seq


def measure(job: dict, timeout_s: float) -> dict:
  """The report row of one compile, in a fresh process, or {'error': why not}."""
  try:
    cfg = job_config(job)
  except ConfigError as e:
    return dict(error=str(e))
  return isolated.run_worker(__file__, job, devices(cfg), cfg.plan.target, timeout_s)


def _worker(job: dict) -> None:
  try:
    cfg = job_config(job)
    target = targets.resolve(cfg.plan.target, devices(cfg))
    mesh = make_mesh(cfg, target.devices)
    row = step_report.step_report(cfg, mesh).row()
    row.update(target=cfg.plan.target, devices=devices(cfg),
               device_bytes=step_report.device_memory_bytes(cfg.plan.device_memory_gb, target))
  except ConfigError as e:
    row = dict(error=str(e))
  except Exception as e:  # noqa: BLE001 (a recipe that does not compile is a finding)
    row = dict(error=f"compile failed: {type(e).__name__}: {str(e).splitlines()[0]}")
  print(json.dumps(row))


def with_operands(row: dict) -> dict:
  """`row` with `OPERANDS` from its config's layout plan where it lacks them: attention's and
  the Gated DeltaNet streams', in the element sizes its target compiles them to."""
  if all(row.get(k) not in (None, "") for k in OPERANDS):
    return row
  try:
    cfg = job_config(dict(row, overrides=json.loads(row["overrides"])))
  except ConfigError:  # the row's error already says why
    return row
  platform = targets.platform_of(cfg.plan.target)
  return dict(row, expected_attention_operand_bytes=step_report.expected_attention_operand_bytes(
      cfg, platform), expected_recurrence_operand_bytes=step_report.
      expected_recurrence_operand_bytes(cfg, platform))


def _ratio(row: dict) -> str:
  """GDN streams' operand bytes / attention's, or '' where either is none (no GDN layers;
  `bp` sends no attention)."""
  attention = float(row.get("expected_attention_operand_bytes") or 0)
  gdn = float(row.get("expected_recurrence_operand_bytes") or 0)
  return f"{gdn / attention:.3f}" if gdn and attention else ""


def parse_variant(text: str) -> tuple[str, list[str]]:
  """'name: KEY=VALUE ...' -> (name, overrides)."""
  name, sep, rest = text.partition(":")
  if not sep or not name.strip() or name.strip() == RECIPE:
    raise SystemExit(f"--variant {text!r}: expected 'name: KEY=VALUE ...' (name not "
                     f"{RECIPE!r})")
  return name.strip(), rest.split()


def jobs(args) -> list[dict]:
  variants = [] if args.variants_only else [(RECIPE, [])]
  variants += [parse_variant(v) for v in args.variant]
  return [dict(config=args.config, variant=name, overrides=overrides, strategy=strategy)
          for name, overrides in variants for strategy in args.strategies]


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return list(csv.DictReader(f))


def merge(old: list[dict], new: list[dict]) -> list[dict]:
  """`old` with the rows of the same (config, variant, strategy) replaced by `new`'s."""
  key = lambda r: tuple(str(r[k]) for k in KEYS)
  fresh = {key(r) for r in new}
  return [r for r in old if key(r) not in fresh] + new


def _gb(value) -> str:
  return "" if value in (None, "") else f"{float(value) / GB:.2f}"


def _tflop(row: dict) -> str:
  if row.get("dot_flops") in (None, ""):
    return ""
  return f"{float(row['dot_flops']) / 1e12:.1f} (+ {float(row['dot_flops_uncounted']) / 1e12:.2f})"


def _collectives(row: dict) -> str:
  keys = ("collective_total_bytes", "attention_collective_total_bytes", "recurrence_bytes",
          "weight_collective_total_bytes")
  return "" if row.get(keys[0]) in (None, "") else " / ".join(_gb(row[k]) for k in keys)


def markdown(rows: list[dict]) -> str:
  lines = ["## The shipped recipes compiled for their target (per device, compile only)", "",
           "Each row: the config file as it ships (`recipe`) or a variant of it, compiled by "
           "`mode=plan`'s train step for the config's `plan.target`; its command is in "
           "recipe_plans.csv. Peak: the compiler's own (XLA:TPU); bound: arguments + temp, "
           "every buffer live at once; host: buffers the step keeps in host memory; on the "
           "device: what XLA's buffer assignment allocates in device memory (host buffers "
           "apart), which fits are judged by; live: its bytes live at the step's peak; "
           "attention: what the layout plan sends a step, check = compiled / plan; GDN / "
           "attention: the program's Gated DeltaNet collective operand bytes over its "
           "attention's (`step_report.recurrence_traffic`, `config_attention_traffic`); "
           "dot TFLOP: the compiled matmuls a step (`hlo_stats.dot_flops`; + one run of "
           "the loops whose trip count is data-dependent, the attention kernel's over the key "
           "chunks it reaches); collectives: the compiled operand bytes a step, in all and "
           "those of the attention, the Gated DeltaNet streams and the weights' ZeRO-3 "
           "gathers and reduce-scatters. Empty: a row compiled before the figure was read.", ""]
  for config in dict.fromkeys(r["config"] for r in rows):
    lines += [f"### {config}", "", "| variant | overrides | strategy | arguments GB | temp GB "
              "| peak GB | bound GB | host GB | on the device GB | live GB | attention GB/step "
              "| check | GDN / attention | dot TFLOP (+ one run) | collectives GB: all / "
              "attention / GDN / weights | fits a device |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["config"] == config):
      overrides = " ".join(json.loads(r["overrides"]))
      if r.get("error"):
        lines.append(f"| {r['variant']} | {overrides} | {r['strategy']} | {r['error']} "
                     f"| | | | | | | | | {_ratio(r)} | | | |")
        continue
      check = f"{float(r['attention_check']):.2f}" if r.get("attention_check") not in (
          None, "") else ""
      lines.append(f"| {r['variant']} | {overrides} | {r['strategy']} "
                   f"| {_gb(r['argument_bytes'])} | {_gb(r['temp_bytes'])} "
                   f"| {_gb(r['peak_bytes'])} | {_gb(r['bound_bytes'])} "
                   f"| {_gb(r['host_bytes'])} | {_gb(r.get('device_allocated_bytes'))} "
                   f"| {_gb(r.get('device_live_bytes'))} "
                   f"| {_gb(r['attention_bytes'])} | {check} | {_ratio(r)} "
                   f"| {_tflop(r)} | {_collectives(r)} "
                   f"| {r['fits']} ({float(r['device_bytes']) / 2**30:.2f} GiB) |")
    commands = dict.fromkeys(r["command"] for r in rows if r["config"] == config)
    lines += ["", *commands, ""]
  return "\n".join(lines)


def write(rows: list[dict], out: str) -> None:
  rows = [with_operands(r) for r in rows]
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "recipe_plans.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out, "recipe_plans.md"), "w") as f:
    f.write(markdown(rows) + "\n")
  write_results_pages(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", help="a config file, relative to the repository")
  parser.add_argument("--strategies", nargs="+")
  parser.add_argument("--variant", action="append", default=[], metavar="'NAME: KEY=VALUE ...'")
  parser.add_argument("--variants-only", action="store_true",
                      help="compile only the variants (the recipe's own rows are kept as they are)")
  parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per compile")
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return _worker(json.loads(args.worker))
  if not (args.config and args.strategies):
    parser.error("--config and --strategies are required")
  command = "python experiments/recipe_plans.py " + " ".join(
      f'"{a}"' if " " in a else a for a in (argv if argv is not None else sys.argv[1:]))
  provenance = produced(command)
  rows = []
  for job in jobs(args):
    result = measure(job, args.timeout)
    row = dict(job, overrides=json.dumps(job["overrides"]), command=provenance, **result)
    if not row.get("error"):
      row["fits"] = "yes" if step_report.fit_of(row) <= row["device_bytes"] else "no"
    rows.append(row)
    print(f"{job['variant']} {job['strategy']}: " + (row.get("error") or
          f"{row['fit_bytes'] / GB:.2f} GB on the device (live {row['device_live_bytes'] / GB:.2f}"
          f"), peak {row['peak_bytes'] / GB:.2f} GB, bound {row['bound_bytes'] / GB:.2f} GB, "
          f"compiled in {row['compile_s']:.0f} s"), flush=True)
  write(merge(read_rows(os.path.join(args.out, "recipe_plans.csv")), rows), args.out)


if __name__ == "__main__":
  main()
