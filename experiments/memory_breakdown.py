"""What XLA:CPU holds at its peak that XLA:TPU does not: one train step, both compilers.

  python experiments/memory_breakdown.py    # Llama-3-8B dims, 8 layers, L = 256K, 16 devices
  python experiments/memory_breakdown.py --quick                         # tiny, for a look

Compiles the same step (`scale_probe.probe_config`: one sequence, bf16 compute, f32
parameters and Adam state, remat full, `--strategy` on a seq axis of `--devices`) for each
`--targets` entry, each in its own process, and reads the buffers live at each compiler's peak
by category from its buffer assignment (`bdlm_jax.analysis.buffers`). Side by side: the
compilers' memory_analysis figures, the categories, the saved residuals, and the buffers of
one shape whose element type differs (what XLA:CPU widens) or that only one compiler holds at
its peak. Writes results/memory_breakdown.md (memory_breakdown_quick.md with --quick).
"""

import argparse
import collections
import dataclasses
import json
import os
import sys

import scale_probe
from bdlm_jax.analysis import buffers, isolated, step_report, targets
from bdlm_jax.analysis.results import produced
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.registry import strategy_names

GB = step_report.GB
# the ring that sends only the clean stream: CSBP's (registry properties, not its name)
CSBP_RING = strategy_names(travels="clean", transport="ring", baseline=False)[0]
QUICK = dict(model="tiny", layers=2, seq_len=128, devices=4, block_size=16,
             targets=["cpu", "tpu:v5e:2x2"])


def job(args, target: str) -> dict:
  """A scale_probe job (its keys) of this setting on `target`."""
  return dict(model=args.model, seq_len=args.seq_len, strategy=args.strategy,
              devices=args.devices, layers=args.layers, block_size=args.block_size,
              remat="full", overrides=[], standins=False, objective="bd3lm", anchors=0,
              drafter_layers=0, target=target)


def _worker(spec: dict) -> None:
  cfg = scale_probe.job_config(spec)
  mesh = make_mesh(cfg, targets.resolve(spec["target"], spec["devices"]).devices)
  _, breakdown = buffers.step_breakdown(cfg, mesh)
  print(json.dumps(dict(buffers=[dataclasses.asdict(b) for b in breakdown.buffers],
                        report=dataclasses.asdict(breakdown.report),
                        platform=breakdown.platform)))


def measure(spec: dict, timeout_s: float) -> buffers.Breakdown:
  """The Breakdown of one compile, in a fresh process (`isolated`)."""
  out = isolated.run_worker(__file__, spec, spec["devices"], spec["target"], timeout_s)
  if "error" in out:
    raise SystemExit(f"{spec['target']}: {out['error']}")
  return buffers.Breakdown(tuple(buffers.Buffer(**b) for b in out["buffers"]),
                           step_report.StepReport(**out["report"]), out["platform"])


def _gb(nbytes: float) -> str:
  return f"{nbytes / GB:.3g}"


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}" if b else "—"


def figures_table(named: dict) -> list[str]:
  """memory_analysis figures and the bytes live at the peak, one column per compiler."""
  names = list(named)
  rows = [("arguments", lambda b: b.report.argument_bytes),
          ("temp", lambda b: b.report.temp_bytes),
          ("bound: arguments + temp + output - alias", lambda b: b.report.bound_bytes),
          ("compiler's peak_memory_in_bytes", lambda b: b.report.compiler_peak_bytes),
          ("buffers live at the peak (sum)", lambda b: b.device_bytes)]
  lines = ["| GB per device | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
  for label, figure in rows:
    cells = [figure(b) for b in named.values()]
    lines.append(f"| {label} | " + " | ".join("—" if c is None else _gb(c) for c in cells) + " |")
  return lines


def category_table(named: dict) -> list[str]:
  """GB per category at each compiler's peak, the first compiler over the last."""
  names, by = list(named), {n: b.by_category() for n, b in named.items()}
  lines = ["| category | " + " | ".join(f"{n} GB" for n in names) +
           f" | {names[0]} / {names[-1]} |", "|---|" + "---|" * (len(names) + 1)]
  for category in buffers.CATEGORIES:
    cells = [by[n][category] for n in names]
    if any(cells):
      lines.append(f"| {category} | " + " | ".join(_gb(c) for c in cells) +
                   f" | {_ratio(cells[0], cells[-1])} |")
  return lines


def _dtype_and_dims(shape: str) -> tuple[str, str]:
  dtype, _, dims = shape.partition("[")
  return dtype, "[" + dims


def widened(named: dict) -> list[str]:
  """Buffers of one category and shape whose element type differs between the peaks, or that
  one compiler holds at its peak and the other does not: (count, GB) per element type,
  largest first."""
  groups = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
  for name, b in named.items():
    for x in b.buffers:
      dtype, dims = _dtype_and_dims(x.shape)
      key = (x.residual or x.category, dims)
      groups[key][name][dtype + " n"] += 1
      groups[key][name][dtype] += x.nbytes

  def held(counter):
    return ", ".join(f"{counter[t + ' n']} x {t} ({_gb(counter[t])} GB)"
                     for t in sorted(k for k in counter if not k.endswith(" n"))) or "none"

  def differs(sides):  # another element type, or held by one compiler only
    return len({frozenset(k for k in sides.get(n, {}) if not k.endswith(" n"))
                for n in named}) > 1

  rows = sorted(((key, sides) for key, sides in groups.items() if differs(sides)),
                key=lambda kv: -max(sum(v for k, v in c.items() if not k.endswith(" n"))
                                    for c in kv[1].values()))
  lines = ["| buffer (what, dims) | " + " | ".join(named) + " |", "|---|" + "---|" * len(named)]
  for (what, dims), sides in rows[:20]:
    lines.append(f"| {what} {dims} | " + " | ".join(held(sides.get(n, {})) for n in named) +
                 " |")
  return lines


def markdown(named: dict, args, command: str) -> str:
  m = scale_probe.MODELS[args.model]
  lines = ["## XLA:CPU vs XLA:TPU: the buffers at each compiler's peak (compile only)", "",
           f"{produced(command)} {args.model} dims (d_model {m.d_model}, "
           f"{args.layers} layers, d_ff {m.d_ff}, vocab {m.vocab_size}), L = {args.seq_len}, "
           f"{args.strategy} on {args.devices} devices, one sequence, block size "
           f"{args.block_size}, bf16 compute, f32 parameters and Adam state, remat full. "
           "Categories and their rules: `bdlm_jax/analysis/buffers.py`.", "",
           *figures_table(named), "", *category_table(named), "",
           "Buffers of one category and shape that the peaks hold in another element type, or "
           "that one peak holds and the other does not (the 20 largest):", "", *widened(named), ""]
  for name, b in named.items():
    lines += [f"### {name}", "", *b.lines(top=args.top), ""]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="llama3-8b", choices=sorted(scale_probe.MODELS))
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=262144)
  parser.add_argument("--devices", type=int, default=16)
  parser.add_argument("--block-size", type=int, default=64)
  parser.add_argument("--strategy", default=CSBP_RING,
                      choices=scale_probe.STRATEGIES)
  parser.add_argument("--targets", nargs="+", default=["cpu", "tpu:v5p:2x2x4"])
  parser.add_argument("--top", type=int, default=15, help="largest buffers listed per compiler")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per compile")
  parser.add_argument("--quick", action="store_true", help="a tiny model on 4 devices")
  parser.add_argument("--out", default=scale_probe.RESULTS_DIR)
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return _worker(json.loads(args.worker))
  if args.quick:
    vars(args).update(QUICK)
  named = {}
  for target in args.targets:
    breakdown = measure(job(args, target), args.timeout)
    named[f"XLA:{targets.platform_of(target).upper()}"] = breakdown
    print(f"{target}: {breakdown.relation()}", file=sys.stderr)
  command = ("python experiments/memory_breakdown.py "
             + " ".join(sys.argv[1:] if argv is None else argv)).strip()
  text = markdown(named, args, command)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"memory_breakdown{'_quick' * args.quick}.md"), "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
