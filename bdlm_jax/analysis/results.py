"""The results pages (docs/results/): the sections the experiment scripts write, joined one
page per topic, each page's sections in a fixed order.

Each script writes its sections (parallel_bench.md, ...) into its results folder, then calls
`write_results_pages`. The repository's results folder (`<repo>/experiments/results`) writes
`<repo>/docs/results/`; a scratch folder (tests, `--out`) gets its pages beside its sections,
so that a test or a trial run never rewrites the docs.
"""

import dataclasses
import datetime
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What produces a figure: an uncommitted change elsewhere (docs, tests, results) cannot move one
CORE = ("bdlm_jax/", "configs/", "experiments/", "run.py")
KERNEL_CSV = "--kernel-csv experiments/results/kernel_bench.csv"
SCALE = ("--models llama3-8b --lens 65536 262144 524288 1048576 --depth-check 0",
         "--models qwen3-8b gemma3-27b --lens 65536 262144 1048576 --strategies csbp_ring "
         "cp_ring --depth-check 0",
         "--models qwen3-30b-a3b --lens 262144 --strategies csbp_ring cp_ring --depth-check 0")

RECIPES = ("--config configs/dflash2_muse_1m.py --strategies csbp_ring cp_replicated_drafts "
           "--variant \"ours: parallel.seq=8 parallel.data=1 train.batch_size=1 "
           "model.param_dtype=float32 model.remat=full\"",
           "--config configs/qwen3_5_27b_fast_dllm_v2_256k.py --strategies csbp_ring cp_ring "
           "csbp_allgather cp_ring_balanced cp_allgather bp --timeout 3000",
           "--config configs/qwen3_5_27b_fast_dllm_v2_1m.py --strategies csbp_ring "
           "csbp_allgather cp_allgather cp_ring cp_ring_balanced bp --timeout 3600",
           "--config configs/llama3_8b_bdlm_1m_4chips.py --strategies csbp_ring cp_ring "
           "cp_ring_balanced csbp_allgather cp_allgather bp --timeout 3600",
           "--config configs/diffusiongemma_26b_a4b_sft_256k.py --strategies csbp_ring "
           "--timeout 3000",
           "--config configs/diffusiongemma_26b_a4b_sft_512k.py --strategies csbp_ring "
           "cp_allgather csbp_allgather cp_ring cp_ring_balanced bp --timeout 3600",
           *(f"--config {c} --strategies csbp_ring --variant \"splash: "
             "model.attention_impl=splash\" --variants-only --timeout 3000"
             for c in ("configs/dflash2_muse_1m.py", "configs/qwen3_5_27b_fast_dllm_v2_256k.py",
                       "configs/diffusiongemma_26b_a4b_sft_256k.py")),
           "--config configs/llama3_8b_bdlm_1m.py --strategies csbp_ring --variant \"splash: "
           "model.attention_impl=splash\" --timeout 3000")
SPLASH_TILES = ("configs/qwen3_5_27b_fast_dllm_v2_256k.py",
                "configs/qwen3_5_27b_fast_dllm_v2_1m.py",
                "configs/diffusiongemma_26b_a4b_sft_256k.py")


def core_version() -> str:
  """The commit, and the uncommitted code files (`CORE`, results aside) a figure may owe to."""
  git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True,
                                  text=True).stdout
  dirty = [path for line in git("status", "--short").splitlines()
           for path in [line[3:].split(" -> ")[-1]]
           if path.startswith(CORE) and not path.startswith("experiments/results/")]
  return git("log", "-1", "--format=%h").strip() + (
      f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")


def produced(command: str) -> str:
  """The provenance line a results file ends a section with: command, time, code."""
  when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  return f"Produced by `{command}` on {when}, core version {core_version()}."


@dataclasses.dataclass(frozen=True)
class Page:
  name: str  # file name under docs/results/ (none is also a section's name)
  title: str
  sections: tuple[str, ...]  # section files of the results folder, in page order
  commands: tuple[str, ...]  # what regenerates them (each section names its exact run)
  images: tuple[tuple[str, str], ...] = ()  # (alt text, file of the results folder)


PAGES = (
    Page("strategies_measured.md", "Parallel strategies, one full train step (measured)",
         ("parallel_bench.md", "parallel_bench_dflash.md"),
         ("python experiments/parallel_bench.py --quick",
          "python experiments/parallel_bench.py --objective dflash"),
         (("attention traffic per device", "parallel_bench_traffic.png"),
          ("temporary memory per device", "parallel_bench_memory.png"),
          ("step time relative to cp_ring", "parallel_bench_time.png"))),
    Page("memory_at_scale.md", "Compiled memory at scale (per device, compile only)",
         ("scale_probe.md", "scale_probe_ablation.md", "scale_probe_tpu.md",
          "scale_probe_dflash.md"),
         (*(f"python experiments/scale_probe.py {a}" for a in SCALE),
          "python experiments/scale_probe.py --ablate --models llama3-8b --lens 262144 "
          "--strategies csbp_ring csbp_allgather cp_ring",
          *(f"python experiments/scale_probe.py --target tpu:v5p:2x2x4 {a}"
            + (" --dispatch real" if "30b" in a else "") for a in SCALE))),
    Page("projections.md", "Cost model: projected step time, memory and scaling",
         ("cost_model.md", "cost_model_scaling.md"),
         (f"python experiments/cost_model.py {KERNEL_CSV}",
          f"python experiments/cost_model.py --scaling {KERNEL_CSV}")),
    Page("local_layers.md", "Local vs global layers: attention traffic",
         ("window_traffic.md",), ("python experiments/window_traffic.py",)),
    Page("recipes.md", "The shipped recipes compiled for their target",
         ("recipe_plans.md",), tuple(f"python experiments/recipe_plans.py {a}" for a in RECIPES)),
    Page("splash.md", "Splash attention: the pairs it computes, per strategy",
         ("splash_tiles.md",),
         tuple(f"python experiments/splash_tiles.py --config {c}" for c in SPLASH_TILES)),
    Page("quickstart.md", "The quickstart, seed by seed",
         ("quickstart_seeds.md",), ("python experiments/quickstart_seeds.py",)),
    Page("conversion.md", "AR -> BDLM conversion: Fast-dLLM v2 forms",
         ("conversion_forms.md",), ("python experiments/conversion_forms.py",)),
    Page("block_sizes.md", "Block size: what the models learn",
         ("block_size_sweep.md",), ("python experiments/block_size_sweep.py",),
         (("held-out loss per block size", "block_size_sweep.png"),)),
)


def pages_dir_for(results_dir: str) -> str:
  """docs/results/ of the repository for its own results folder; else the folder itself."""
  results_dir = os.path.abspath(results_dir)
  experiments = os.path.dirname(results_dir)
  if (os.path.basename(results_dir), os.path.basename(experiments)) == ("results",
                                                                         "experiments"):
    return os.path.join(os.path.dirname(experiments), "docs", "results")
  return results_dir


def page_text(page: Page, results_dir: str, pages_dir: str) -> str:
  """`page` from the sections present in `results_dir` (images linked from `pages_dir`)."""
  commands = " && ".join(page.commands)
  parts = [f"# {page.title}\n\nGenerated by `bdlm_jax/analysis/results.py` from the sections "
           f"the experiment scripts write; do not edit. Regenerate with `{commands}`."]
  parts += [f"![{alt}]({os.path.relpath(os.path.join(results_dir, image), pages_dir)})"
            for alt, image in page.images if os.path.exists(os.path.join(results_dir, image))]
  for name in page.sections:
    path = os.path.join(results_dir, name)
    if os.path.exists(path):
      with open(path) as f:
        parts.append(f.read().strip())
  return "\n\n".join(parts) + "\n"


def write_results_pages(results_dir: str) -> list[str]:
  """Writes each page of PAGES that has a section in `results_dir`; returns their paths."""
  pages_dir = pages_dir_for(results_dir)
  os.makedirs(pages_dir, exist_ok=True)
  written = []
  for page in PAGES:
    if any(os.path.exists(os.path.join(results_dir, s)) for s in page.sections):
      path = os.path.join(pages_dir, page.name)
      with open(path, "w") as f:
        f.write(page_text(page, results_dir, pages_dir))
      written.append(path)
  return written
