"""README_results.md: the sections the experiment scripts write, joined in a fixed order.

The repository's results folder (`<repo>/experiments/results`) also refreshes the block
between the results markers of the project README; a scratch folder (tests, `--out`) never
does.
"""

import os

SECTIONS = ("parallel_bench.md", "scale_probe.md", "scale_probe_ablation.md",
            "scale_probe_tpu.md", "cost_model.md", "cost_model_scaling.md",
            "parallel_bench_dflash.md", "scale_probe_dflash.md", "window_traffic.md",
            "block_size_sweep.md")
SCALE = ("--models llama3-8b --lens 65536 262144 524288 1048576 --depth-check 0",
         "--models qwen3-8b gemma3-27b --lens 65536 262144 1048576 --strategies csbp_ring "
         "cp_ring --depth-check 0",
         "--models qwen3-30b-a3b --lens 262144 --strategies csbp_ring cp_ring --depth-check 0")
HEADER = ("# Results\n\n"
          "Generated; do not edit. Regenerate with "
          "`python experiments/parallel_bench.py --quick && "
          + " && ".join(f"python experiments/scale_probe.py {a}" for a in SCALE)
          + " && python experiments/scale_probe.py --ablate --models llama3-8b --lens 262144 "
          "--strategies csbp_ring csbp_allgather cp_ring && "
          + " && ".join(f"python experiments/scale_probe.py --target tpu:v5p:2x2x4 {a}"
                        + (" --dispatch real" if "30b" in a else "") for a in SCALE)
          + " && python experiments/cost_model.py "
          "--kernel-csv experiments/results/kernel_bench.csv "
          "&& python experiments/cost_model.py --scaling "
          "--kernel-csv experiments/results/kernel_bench.csv` "
          "(XLA:TPU's after XLA:CPU's, which they are put beside; and "
          "`python experiments/window_traffic.py`, `python experiments/block_size_sweep.py` "
          "for the last sections).\n")
RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"


def write_results_readme(results_dir: str) -> str:
  """Writes `results_dir`/README_results.md and returns its path."""
  parts = [HEADER]
  for name in SECTIONS:
    path = os.path.join(results_dir, name)
    if os.path.exists(path):
      with open(path) as f:
        parts.append(f.read())
  text = "\n".join(parts)
  path = os.path.join(results_dir, "README_results.md")
  with open(path, "w") as f:
    f.write(text)
  results_dir = os.path.abspath(results_dir)
  experiments = os.path.dirname(results_dir)
  if (os.path.basename(results_dir), os.path.basename(experiments)) == ("results",
                                                                         "experiments"):
    body = text.replace("# Results\n", "", 1)
    _splice(os.path.join(os.path.dirname(experiments), "README.md"),
            body.replace("\n### ", "\n#### ").replace("\n## ", "\n### "))
  return path


def _splice(readme: str, text: str) -> None:
  """Puts `text` between the results markers of `readme`, if it has them."""
  if not os.path.exists(readme):
    return
  with open(readme) as f:
    current = f.read()
  if RESULTS_START not in current or RESULTS_END not in current:
    return
  head, rest = current.split(RESULTS_START, 1)
  tail = rest.split(RESULTS_END, 1)[1]
  with open(readme, "w") as f:
    f.write(f"{head}{RESULTS_START}\n{text.strip()}\n{RESULTS_END}{tail}")
