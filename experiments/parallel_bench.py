"""Every sequence strategy side by side on one full train step (forward, backward, AdamW).

  python experiments/parallel_bench.py --quick   # a few minutes on 2 CPU cores
  python experiments/parallel_bench.py --tiny    # CI smoke run, < 60 s
  python experiments/parallel_bench.py           # the full grid
  python experiments/parallel_bench.py --objective dflash   # a DFlash drafter's step, one (L, P)

For each (strategy, seq ranks P, sequence length L) it compiles the real
`make_train_step(cfg, mesh)` on a batch from `make_batch` and records, per device: collective
bytes by kind read from the compiled HLO (`hlo_stats`), temp and argument memory
(`memory_analysis()`), XLA's FLOP count (`cost_analysis()`), the useful model FLOPs
(`model_flops_per_step`) and the median wall time of a few steps with its ratio to `cp_ring`
at the same (P, L) in the same run. Without an accelerator it runs on 8 simulated CPU
devices: bytes, memory and FLOPs are exact for that program, wall times are comparable only
as ratios. Writes parallel_bench.{csv,md} and parallel_bench_*.png under --out and refreshes
the results pages (docs/results/).

`--objective dflash` (docs/dflash.md) benches a drafter's step instead, at one (L, P)
(`--tiny`: the CI smoke size): the frozen target's causal forward over the context, then the
drafter's forward + backward over the draft blocks, for every strategy but cp_ring_balanced
(whose drafter layout is cp_ring's). It writes parallel_bench_dflash.{csv,md} and no plots.

Traffic is split in two: the collectives issued inside the attention `shard_map` move K/V
and their gradients; the rest (parameter all-gathers, gradient reductions) is weight traffic,
the same program for every strategy. `attn_wire_bytes` converts the attention's HLO operand
bytes to bytes each device sends with ring algorithms (`hlo_stats.wire_bytes`: all-gather
shard x (P-1), reduce-scatter input x (P-1)/P, collective-permute as is), so all-gather and
ring transports compare on one scale. `attn_check` divides the compiled attention operand
bytes by what the layout plan says its transport issues (`step_report.
expected_attention_operand_bytes`): 1.00 when the core moves exactly that, a little below when
XLA hoists or merges the layer-invariant row-metadata collectives.
"""

import argparse
import csv
import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # simulated mesh when no accelerator

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bdlm_jax import init_state, make_batch, make_mesh, make_train_step  # noqa: E402
from bdlm_jax.analysis import hlo_stats  # noqa: E402
from bdlm_jax.analysis.cost_model.work import distinct_plans  # noqa: E402
from bdlm_jax.analysis.results import write_results_pages  # noqa: E402
from bdlm_jax.analysis.step_report import (describe_objective,  # noqa: E402
                                           expected_attention_operand_bytes)
from bdlm_jax.config import Config  # noqa: E402
from bdlm_jax.configure import replace  # noqa: E402
from bdlm_jax.metrics import model_flops_per_step  # noqa: E402
from bdlm_jax.objectives import get_objective  # noqa: E402
from bdlm_jax.parallel.mesh import row_sharding  # noqa: E402
from bdlm_jax.parallel.registry import get_strategy, plan_for, strategy_names  # noqa: E402
from bdlm_jax.parallel.strategies import ATTENTION_SCOPE  # noqa: E402
from bdlm_jax.train import state_shardings  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
STRATEGIES = strategy_names()  # every one, in the tables' order
BD3LM_STRATEGIES = strategy_names(needs_drafter=False)  # what the BD3-LM grids run
# Each row's step time is also given over the first ring baseline's, cp_ring (time_vs_cp_ring)
BASELINE = strategy_names(baseline=True, transport="ring")[0]
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Grid:
  model: dict
  seq_lens: tuple
  seqs: tuple
  block_size: int
  warmup: int
  steps: int
  objective: dict = dataclasses.field(default_factory=dict)  # name and its other fields
  drafter: dict = dataclasses.field(default_factory=dict)  # objective dflash: its drafter

  @property
  def stem(self) -> str:
    """The results' file name: parallel_bench, or parallel_bench_<objective>."""
    name = self.objective.get("name")
    return "parallel_bench" + (f"_{name}" if name else "")


# Key chunks small enough that every K/V part spans several: a part that fits in one chunk
# makes a one-trip scan, which XLA inlines, keeping the forward and backward score blocks
# live together (csbp_ring at 256 rows/rank showed 1.3x cp_ring's temp memory with 128-key
# chunks, 0.99x with 64).
GRIDS = {
    "tiny": Grid(dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      attention_chunk=32), seq_lens=(64,), seqs=(8,), block_size=4,
                 warmup=1, steps=2),
    "quick": Grid(dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, d_ff=256,
                       attention_chunk=16), seq_lens=(256, 512, 1024), seqs=(4, 8),
                  block_size=16, warmup=1, steps=3),
    "full": Grid(dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, d_ff=256,
                      attention_chunk=16), seq_lens=(256, 512, 1024, 2048), seqs=(2, 4, 8),
                 block_size=16, warmup=2, steps=5),
    # DFlash: the quick grid's model as the frozen target, a 2-layer drafter with 2 K/V heads
    # of 32 (not the target's 16: the two parts' K/V widths differ), 32 draft blocks of 16
    # (512 draft rows, dual-end pairs on 8 ranks) over L = 1024 context rows.
    "dflash": Grid(dict(d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16,
                        d_ff=256, attention_chunk=16), seq_lens=(1024,), seqs=(8,),
                   block_size=16, warmup=1, steps=3,
                   objective=dict(name="dflash", max_anchors=32),
                   drafter=dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32)),
    "dflash_tiny": Grid(dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                             d_ff=64, attention_chunk=32), seq_lens=(64,), seqs=(8,),
                        block_size=4, warmup=1, steps=2,
                        objective=dict(name="dflash", max_anchors=8),
                        drafter=dict(n_layers=1, n_kv_heads=1, head_dim=16)),
}

COLUMNS = ("strategy", "seq", "seq_len", "block_size", "rows_per_rank", "max_rank_pairs",
           "attn_wire_bytes", "attn_check", "all_gather_bytes", "reduce_scatter_bytes",
           "collective_permute_bytes", "all_to_all_bytes", "all_reduce_bytes", "temp_bytes",
           "argument_bytes", "xla_flops", "model_flops_per_device", "step_ms",
           "time_vs_cp_ring", "compile_s", "backend", "dtype", "objective")


def bench_config(grid: Grid, strategy: str, seq: int, seq_len: int, dtype: str) -> Config:
  return replace(Config(), model=dict(grid.model, compute_dtype=dtype),
                 data=dict(seq_len=seq_len),
                 objective=dict(grid.objective, block_size=grid.block_size),
                 drafter=grid.drafter, parallel=dict(strategy=strategy, seq=seq),
                 train=dict(batch_size=1))


@dataclasses.dataclass
class _Compiled:
  """One configuration, compiled and ready to step."""
  row: dict
  step: object  # jax.stages.Compiled
  state: object
  batch: object
  times: list = dataclasses.field(default_factory=list)


def compile_config(cfg: Config, host_state, tokens: np.ndarray) -> _Compiled:
  """Compiles one configuration's train step and reads its static costs."""
  mesh = make_mesh(cfg)
  p = cfg.parallel.seq
  plan = plan_for(cfg)
  state = jax.device_put(host_state, state_shardings(cfg, mesh))
  batch = jax.device_put(make_batch(cfg, tokens), row_sharding(mesh))
  start = time.perf_counter()
  compiled = make_train_step(cfg, mesh).lower(state, batch, jax.random.key(1)).compile()
  compile_s = time.perf_counter() - start
  by_kind = hlo_stats.collective_bytes(compiled)
  attention = hlo_stats.collective_bytes(compiled, ATTENTION_SCOPE)
  expected = expected_attention_operand_bytes(cfg)
  memory = hlo_stats.memory_stats(compiled)
  row = dict(
      strategy=cfg.parallel.strategy, seq=p, seq_len=cfg.data.seq_len,
      block_size=cfg.objective.block_size, rows_per_rank=plan.rows_per_rank,
      max_rank_pairs=int(plan.attention_work().max()),
      attn_wire_bytes=hlo_stats.wire_bytes(attention, p),
      attn_check=sum(attention.values()) / expected if expected else None,
      all_gather_bytes=by_kind["all-gather"], reduce_scatter_bytes=by_kind["reduce-scatter"],
      collective_permute_bytes=by_kind["collective-permute"],
      all_to_all_bytes=by_kind["all-to-all"], all_reduce_bytes=by_kind["all-reduce"],
      temp_bytes=memory["temp_size_in_bytes"], argument_bytes=memory["argument_size_in_bytes"],
      xla_flops=hlo_stats.flops(compiled), model_flops_per_device=model_flops_per_step(cfg) / p,
      step_ms=None, time_vs_cp_ring=None, compile_s=compile_s,
      backend=jax.default_backend(), dtype=cfg.model.compute_dtype,
      objective=cfg.objective.name)
  return _Compiled(row, compiled, state, batch)


def time_round_robin(runs: list[_Compiled], warmup: int, steps: int) -> None:
  """Median step time of each run, stepping them in turn so that a change in the host's
  load (a shared CPU) hits every strategy alike."""
  key = jax.random.key(2)
  for i in range(warmup + steps):
    for run in runs:
      start = time.perf_counter()
      run.state, metrics = run.step(run.state, run.batch, jax.random.fold_in(key, i))
      jax.block_until_ready((run.state, metrics))
      if i >= warmup:
        run.times.append(time.perf_counter() - start)
  for run in runs:
    run.row["step_ms"] = 1e3 * statistics.median(run.times)


def run(grid: Grid, out_dir: str, dtype: str, strategies=BD3LM_STRATEGIES, progress=print):
  """Measures every configuration of `grid`; writes CSV and markdown (`grid.stem`), and for
  the BD3-LM grids the plots; refreshes the results pages; returns rows."""
  rows = []
  tokens_rng = np.random.default_rng(0)
  seqs = [s for s in grid.seqs if s <= jax.device_count()]
  splits = lambda name: get_strategy(name).splits_sequences
  one_device = [x for x in strategies if not splits(x)]
  groups = [(1, one_device)] if one_device else []
  groups += [(s, [x for x in strategies if splits(x)]) for s in seqs]
  host_state = None  # one initial state, placed on each mesh (no init compile per mesh)
  for seq, names in groups:
    if host_state is None:
      base = bench_config(grid, names[0], seq, grid.seq_lens[0], dtype)
      host_state = jax.device_get(init_state(base, jax.random.key(0), make_mesh(base)))
    for seq_len in grid.seq_lens:
      tokens = tokens_rng.integers(0, 250, (1, seq_len))  # never the [MASK] id
      runs = [compile_config(bench_config(grid, strategy, seq, seq_len, dtype), host_state,
                             tokens) for strategy in names]
      time_round_robin(runs, grid.warmup, grid.steps)
      for r in (run.row for run in runs):
        rows.append(r)
        progress(f"{r['strategy']:>15} P={seq} L={seq_len}: {r['step_ms']:.0f} ms, attention "
                 f"{r['attn_wire_bytes'] / MiB:.2f} MiB, temp {r['temp_bytes'] / MiB:.1f} MiB "
                 f"(compile {r['compile_s']:.1f} s)")
  _add_time_ratios(rows)
  os.makedirs(out_dir, exist_ok=True)
  write_csv(rows, os.path.join(out_dir, f"{grid.stem}.csv"))
  with open(os.path.join(out_dir, f"{grid.stem}.md"), "w") as f:
    f.write(markdown(rows, grid, dtype))
  if grid.stem == "parallel_bench":  # the results pages show this one's plots
    plot(rows, out_dir)
  write_results_pages(out_dir)
  return rows


def _add_time_ratios(rows):
  base = {(r["seq"], r["seq_len"]): r["step_ms"] for r in rows if r["strategy"] == BASELINE}
  for r in rows:
    ref = base.get((r["seq"], r["seq_len"]))
    r["time_vs_cp_ring"] = r["step_ms"] / ref if ref else None


def write_csv(rows, path):
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)


def _fmt(x, spec):
  return "—" if x is None else format(x, spec)


def markdown(rows, grid: Grid, dtype: str) -> str:
  backend = rows[0]["backend"]
  simulated = backend == "cpu"
  timing = "simulated devices: ratios only" if simulated else jax.devices()[0].device_kind
  m = grid.model
  cfg = bench_config(grid, strategy_names(splits_sequences=False)[0], 1, grid.seq_lens[0],
                     dtype)
  drafter = get_objective(cfg.objective.name).DRAFTER
  lines = [
      "## DFlash drafter training, one full train step (measured)" if drafter else
      "## Parallel strategies, one full train step (measured)", "",
      f"{'Frozen target' if drafter else 'Model'}: {m['n_layers']} layers, d_model "
      f"{m['d_model']}, {m['n_heads']} query / "
      f"{m['n_kv_heads']} K/V heads of {m['head_dim']}, d_ff {m['d_ff']}, `xla` attention in "
      f"chunks of {m['attention_chunk']} keys; "
      + (f"objective {describe_objective(cfg)}; " if drafter else "") + "block size "
      f"{grid.block_size}; one sequence per step; {dtype}; backend `{backend}` "
      f"({jax.device_count()} devices). Produced by `experiments/parallel_bench.py"
      + (f" --objective {cfg.objective.name}`." if drafter else "`."), "",
      *([_DRAFTER_NOTE, ""] if drafter else []),
      "Per device and step. *attn MiB*: bytes each device sends for attention K/V and their "
      "gradients (HLO collectives inside the attention `shard_map`, converted to "
      "ring-algorithm wire bytes); *check*: compiled attention operand bytes ÷ what the "
      "layout plan's transport issues (`step_report.expected_attention_operand_bytes`); "
      "*all-reduce MiB*: the weight-gradient reduction (HLO "
      "operand bytes; XLA:CPU compiles ZeRO-3's reduce-scatter of the gradients as an "
      "all-reduce and a slice). *max pairs*: allowed (query, key) pairs on the busiest "
      + ("rank, of the drafter's draft queries. " if drafter else "rank. ") +
      "*XLA GFLOP* counts each while-loop body once (scans over key "
      "chunks and ring steps are undercounted); *model GFLOP* is the useful work per device. "
      f"*step ms*: median of {grid.steps} steps after {grid.warmup} warm-up, the strategies of "
      f"one (P, L) stepped in turn ({timing}); *÷ cp_ring*: same P and L, same run.",
      "",
      "| P | L | strategy | rows/rank | max pairs | attn MiB | attn ÷ cp | check | "
      "all-reduce MiB | temp MiB | arg MiB | XLA GFLOP | model GFLOP | step ms | ÷ cp_ring |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  at = {(r["seq"], r["seq_len"], r["strategy"]): r for r in rows}
  for r in sorted(rows, key=lambda r: (r["seq"], r["seq_len"], STRATEGIES.index(r["strategy"]))):
    cp = cp_of(get_strategy(r["strategy"]).transport)
    ref = cp and at.get((r["seq"], r["seq_len"], cp[0]), {}).get("attn_wire_bytes")
    lines.append(
        f"| {r['seq']} | {r['seq_len']} | {r['strategy']} | {r['rows_per_rank']} | "
        f"{r['max_rank_pairs']} | {r['attn_wire_bytes'] / MiB:.3f} | "
        f"{_fmt(r['attn_wire_bytes'] / ref if ref else None, '.2f')} | "
        f"{_fmt(r['attn_check'], '.2f')} | {r['all_reduce_bytes'] / MiB:.3f} | "
        f"{r['temp_bytes'] / MiB:.2f} | {r['argument_bytes'] / MiB:.2f} | "
        f"{r['xla_flops'] / 1e9:.2f} | {r['model_flops_per_device'] / 1e9:.3f} | "
        f"{r['step_ms']:.0f} | "
        f"{_fmt(r['time_vs_cp_ring'], '.2f')} |")
  lines += ["", "*attn ÷ cp*: csbp over cp with the same transport." + ("" if drafter else
            " Plots: `parallel_bench_traffic.png`, `parallel_bench_memory.png`, "
            "`parallel_bench_time.png`."), "", "What the table shows (computed from it):", ""]
  lines += summary(rows) + [""]
  return "\n".join(lines)


_DRAFTER_NOTE = (
    "A drafter's step: the frozen target runs a causal forward (no backward) over each rank's "
    "context rows (its clean slot), and its attention moves every context row's K/V forward "
    "under cp_* and csbp_* (nothing under bp, which replicates the whole context, so every "
    "rank runs the target over all L rows); then the drafter's layers run forward + backward "
    "over the draft rows, whose keys are the draft rows and the context: cp_* moves both "
    "(and their gradients back), csbp_* the context only, bp nothing. *rows/rank*: draft + "
    "context rows per rank.")


def _span(values, spec=".2f") -> str:
  lo, hi = min(values), max(values)
  return format(lo, spec) if format(lo, spec) == format(hi, spec) else \
      f"{format(lo, spec)}-{format(hi, spec)}"


def cp_of(transport: str) -> tuple[str, ...]:
  """The context-parallel baseline that moves K/V by `transport` (the first registered one,
  whom the table compares CSBP with); none for `local`."""
  return strategy_names(baseline=True, transport=transport)[:1]


def summary(rows) -> list[str]:
  """One line per claim the table supports, with the measured range over all (P, L)."""
  at = {(r["seq"], r["seq_len"], r["strategy"]): r for r in rows}
  sharded = [r for r in rows if get_strategy(r["strategy"]).splits_sequences]
  lines = []
  for transport in ("ring", "allgather"):
    for csbp, cp in zip(strategy_names(travels="clean", transport=transport, baseline=False),
                         cp_of(transport)):
      ratios = [r["attn_wire_bytes"] / at[(r["seq"], r["seq_len"], cp)]["attn_wire_bytes"]
                for r in sharded if r["strategy"] == csbp and (r["seq"], r["seq_len"], cp) in at]
      if ratios:
        lines.append(f"* {csbp} sends {_span(ratios)}x the attention bytes of {cp}.")
  for local in strategy_names(splits_sequences=True, transport="local"):
    sent = [r["attn_wire_bytes"] for r in rows if r["strategy"] == local]
    if sent:
      lines.append(f"* {local} sends {_span(sent, '.0f')} attention bytes.")
  all_reduce = [r["all_reduce_bytes"] / MiB for r in sharded]
  lines.append(f"* The weight-gradient all-reduce is {_span(all_reduce, '.3f')} MiB over every "
               "sharded strategy and configuration.")
  for strategy in STRATEGIES:
    mine = [r for r in sharded if r["strategy"] == strategy and r["strategy"] != BASELINE
            and (r["seq"], r["seq_len"], BASELINE) in at]
    if not mine:
      continue
    temp = [r["temp_bytes"] / at[(r["seq"], r["seq_len"], BASELINE)]["temp_bytes"]
            for r in mine]
    time_ratio = [r["time_vs_cp_ring"] for r in mine]
    lines.append(f"* {strategy} ÷ cp_ring: temp memory {_span(temp)}x, step time "
                 f"{_span(time_ratio)}x (median {statistics.median(time_ratio):.2f}x).")
  if rows[0]["backend"] == "cpu":
    lines.append("* Simulated devices share the host's cores, so step time follows the total "
                 "work of all ranks (bp's replicated clean prefix; the `xla` kernel skips key "
                 "chunks without an allowed pair but computes the masked pairs of the others), "
                 "not a parallel step's critical path.")
  return lines


def plot(rows, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  seqs = sorted({r["seq"] for r in rows if get_strategy(r["strategy"]).splits_sequences})
  panels = [("traffic", "attn_wire_bytes", MiB, "attention MiB sent / device / step"),
            ("memory", "temp_bytes", MiB, "temp MiB / device"),
            ("time", "time_vs_cp_ring", 1, "step time ÷ cp_ring")]
  for name, field, scale, ylabel in panels:
    fig, axes = plt.subplots(1, len(seqs), figsize=(4.5 * len(seqs), 3.6), squeeze=False)
    for ax, seq in zip(axes[0], seqs):
      for strategy in STRATEGIES:
        pts = sorted((r["seq_len"], r[field] / scale) for r in rows
                     if r["strategy"] == strategy and r["seq"] in (seq, 1)
                     and r[field] is not None)
        if pts:
          ax.plot(*zip(*pts), marker="o", label=strategy,
                  color=f"C{STRATEGIES.index(strategy)}")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("sequence length L")
      ax.set_title(f"P = {seq}" + (" (simulated CPU)" if rows[0]["backend"] == "cpu" else ""))
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"parallel_bench_{name}.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
  size.add_argument("--tiny", action="store_true", help="CI smoke run (< 60 s)")
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--dtype", default=None,
                      help="compute dtype; default float32 on CPU (XLA:CPU runs bf16 "
                           "collectives in f32), bfloat16 on accelerators")
  parser.add_argument("--strategies", default="",
                      help="comma-separated; default every strategy of the objective")
  parser.add_argument("--objective", default="bd3lm", choices=("bd3lm", "dflash"),
                      help="dflash: a drafter's step at one (L, P) (--tiny: the CI size)")
  args = parser.parse_args(argv)
  if args.objective == "dflash":
    grid = GRIDS["dflash_tiny" if args.tiny else "dflash"]
    default = distinct_plans(STRATEGIES, grid.seq_lens[0], grid.block_size, grid.seqs[0],
                             grid.objective["max_anchors"])
  else:
    grid = GRIDS["tiny" if args.tiny else "quick" if args.quick else "full"]
    default = BD3LM_STRATEGIES
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  strategies = tuple(args.strategies.split(",")) if args.strategies else default
  return run(grid, args.out, dtype, strategies)


if __name__ == "__main__":
  main()
