"""The work Splash does under each strategy: the (query, key) pairs its kernels compute
beside the pairs the BDLM mask allows, for one sequence of a recipe, every rank, every step.

  python experiments/splash_tiles.py                      # Qwen3.5-27B conversion, 256K, 16 ranks
  python experiments/splash_tiles.py --config configs/qwen3_5_27b_fast_dllm_v2_1m.py \
      --strategies csbp_ring cp_ring_balanced

Deterministic: every kernel call a strategy's global attention layer makes
(`kernels.tiles.kernel_calls`: local rows, each ring step's pair of row sets, the gathered
rows), each call's tile map built as the kernel builds it (`kernels.splash.computed_pairs`).
"mask density" = allowed pairs / the calls' query x key pairs; "computed" = the visited
tiles' area (both streams' calls, padding rows included) / the same pairs; "computed /
allowed" = the work per useful pair. Also what building one call's masks costs against the
attention it steers (XLA:CPU's cost analysis of the largest call). Writes
results/splash_tiles.{csv,md} (rows of other configs are kept).
"""

import argparse
import csv
import os
import sys
import time

import jax
import jax.numpy as jnp

from bdlm_jax.analysis.results import produced
from bdlm_jax.configure import load_config, override
from bdlm_jax.kernels import splash, tiles
from bdlm_jax.parallel.registry import get_strategy, plan_for, strategy_names_for

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_CONFIG = "configs/qwen3_5_27b_fast_dllm_v2_256k.py"
COLUMNS = ("config", "strategy", "calls", "pairs", "allowed_pairs", "computed_pairs",
           "mask_density", "computed_fraction", "computed_per_allowed", "largest_call",
           "build_mflop", "build_mb", "attention_gflop", "produced")


def measure(cfg, strategy: str) -> dict:
  """One strategy's row: its calls' pairs, allowed and computed, and what building its
  largest call's masks costs (`mask_build_cost`)."""
  cfg = override(cfg, [f"parallel.strategy={strategy}"])
  plan = plan_for(cfg)
  calls = pairs = computed = 0
  largest = None
  for q_meta, k_meta in tiles.kernel_calls(plan, get_strategy(plan.strategy).transport):
    calls += 1
    call_pairs = splash.computed_pairs(q_meta, k_meta)
    pairs += q_meta.seg.shape[1] * k_meta.seg.shape[1]
    computed += call_pairs
    if largest is None or q_meta.seg.size * k_meta.seg.size > largest[0]:
      largest = (q_meta.seg.size * k_meta.seg.size, q_meta, k_meta, call_pairs)
  allowed = int(plan.attention_work().sum())
  return dict(strategy=strategy, calls=calls, pairs=pairs, allowed_pairs=allowed,
              computed_pairs=computed, mask_density=f"{allowed / pairs:.4f}",
              computed_fraction=f"{computed / pairs:.4f}",
              computed_per_allowed=f"{computed / allowed:.3f}",
              **mask_build_cost(cfg, *largest[1:]))


def mask_build_cost(cfg, q_meta, k_meta, call_pairs: int) -> dict:
  """XLA:CPU's cost analysis of building one call's masks (sort, intervals, tile maps)
  beside the forward attention FLOPs of the `call_pairs` it then computes."""
  one = lambda m: jax.tree.map(lambda x: jnp.asarray(x[0]), m)
  cost = jax.jit(splash.plan_calls).lower(one(q_meta), one(k_meta._replace(lo=None)))
  cost = cost.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  attention = 4 * call_pairs * cfg.model.n_heads * cfg.model.head_dim
  return dict(largest_call=f"{q_meta.seg.shape[1]}x{k_meta.seg.shape[1]}",
              build_mflop=f"{cost.get('flops', 0.0) / 1e6:.1f}",
              build_mb=f"{cost.get('bytes accessed', 0.0) / 1e6:.1f}",
              attention_gflop=f"{attention / 1e9:.1f}")


def write(rows: list[dict], out: str) -> None:
  """Merges `rows` into results/splash_tiles.csv (other configs' rows kept), renders .md."""
  path = os.path.join(out, "splash_tiles.csv")
  old = []
  if os.path.exists(path):
    with open(path) as f:
      old = [r for r in csv.DictReader(f) if r["config"] != rows[0]["config"]]
  rows = old + rows
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  lines = ["## Splash: the pairs its kernels compute beside the mask, per strategy", "",
           "One sequence, one global attention layer: every kernel call of every rank and "
           "step. mask density = allowed / the calls' query x key pairs; computed = the "
           "visited tiles' area (the clean-key and noisy-key calls, padding included) / the "
           "same pairs; computed / allowed = work per useful pair. Mask building = XLA:CPU's "
           "cost analysis of `splash.plan_calls` (key sort, intervals, tile maps) for the "
           "strategy's largest call, beside the forward attention FLOPs of the pairs it then "
           "computes (4 x pairs x heads x head dim).", ""]
  for config in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == config]
    lines += [f"### {config}", "", "| strategy | calls | mask density | computed | computed "
              "/ allowed | largest call | mask building MFLOP | MB | attention GFLOP |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['strategy']} | {r['calls']} | {r['mask_density']} | "
              f"{r['computed_fraction']} | {r['computed_per_allowed']} | {r['largest_call']} | "
              f"{r['build_mflop']} | {r['build_mb']} | {r['attention_gflop']} |" for r in mine]
    lines += ["", mine[0]["produced"], ""]
  with open(os.path.join(out, "splash_tiles.md"), "w") as f:
    f.write("\n".join(lines))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=DEFAULT_CONFIG)
  parser.add_argument("--strategies", nargs="+",
                      help="default: every one that can train the config's objective")
  parser.add_argument("--out", default=RESULTS_DIR)
  args = parser.parse_args(argv)
  cfg = load_config(args.config)
  strategies = args.strategies or strategy_names_for(cfg.objective.name, splits_sequences=True)
  command = " ".join(["python experiments/splash_tiles.py",
                      *(sys.argv[1:] if argv is None else argv)])
  rows = []
  for strategy in strategies:
    start = time.time()
    rows.append(dict(config=args.config, **measure(cfg, strategy), produced=produced(command)))
    print(f"{strategy}: {rows[-1]} ({time.time() - start:.0f} s)", flush=True)
  write(rows, args.out)


if __name__ == "__main__":
  main()
