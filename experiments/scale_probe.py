"""Does the real train step fit a device at paper scale? Compile-only, per device, per strategy.

  python experiments/scale_probe.py --models llama3-8b --lens 262144 524288 1048576
  python experiments/scale_probe.py                 # every model, L = 64K..1M
  python experiments/scale_probe.py --quick         # a tiny model, for tests (~10 s)
  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models llama3-8b --lens 262144 \
      --strategies csbp_ring                         # XLA:TPU ahead of time (needs libtpu)
  python experiments/scale_probe.py --ablate --models llama3-8b --lens 262144 \
      --strategies csbp_ring csbp_allgather          # what each memory feature buys
  python experiments/scale_probe.py --objective dflash --models qwen3-8b --devices 8 \
      --lens 1048576 --block-size 16 --anchors 512 --strategies csbp_ring cp_ring bp
                                                     # a DFlash drafter's step over a frozen 8B

For each (model, L, strategy) it compiles `make_train_step` on P devices of `--target` (the
seq axis; one sequence per step; bf16 compute, f32 parameters, `--remat`) from abstract inputs
(`bdlm_jax.analysis.step_report`) and records per device: arguments, temp and peak memory
(peak: the compiler's own where it reports one, XLA:TPU and XLA:GPU; else, as on XLA:CPU, the
bound arguments + temp + output - alias, which is recorded too), compile time, the attention
bytes the layout plan sends per step, the compiled/plan check of those bytes, and compiled
weight traffic. `--target` (`bdlm_jax.analysis.targets`): cpu (default: simulated CPU
devices), tpu:<topology> (XLA:TPU ahead of time; writes scale_probe_tpu.*), gpu (XLA:GPU,
mock hosts beyond this GPU host; writes scale_probe_gpu.*). Each
compile runs in its own subprocess (host memory is freed after each; a crash or a timeout is
a row, not the end of the run) with no persistent compilation cache (compile times are real).
A strategy the config rejects (ConfigError) or that fails to compile is reported as such.
`--breakdown` reads each compile's buffers live at its peak by category (state, saved residuals,
ring buffers, loss chunk, ...; `bdlm_jax.analysis.buffers`), prints them under each row and
writes them to scale_probe*_breakdown.md.
`--depth-check N` also compiles the first strategy at the first L with N layers, so the
markdown shows how compile time grows with depth (the layer scan should keep it flat).
`--jobs 2` halves the wall time on two cores, at the price of noisier compile times.
`--ablate` compiles the first model at the first L once per entry of ABLATIONS, each turning
one memory feature off (or one option on), so the table shows what each buys.

Writes scale_probe.{csv,md,png} under --out (scale_probe_quick.* with --quick). A run merges
into what is there: the rows it measures replace their earlier figures, every other row stays,
and the markdown sections of the other models stay as written (a run of one model, length or
strategy never drops the rest of the table; `--out` writes elsewhere). A table of another
compiler puts each setting beside XLA:CPU's figure of it, from the scale_probe.csv of the same
folder, with the ratio and both verdicts. XLA:CPU is not the GPU
compiler: its memory is the structure to optimise, not a GPU's exact figure. Model presets
(the Llama-style block of bdlm_jax.models): llama3-8b, gemma3-27b and qwen3-30b-a3b as in
`bdlm_jax.analysis.cost_model.setting` (Gemma 3 27B's dimensions and
5 local : 1 global layers; Qwen3-30B-A3B's, a mixture of experts),
qwen3-8b (Qwen3-8B's dimensions, qk_norm), qwen3.5-27b (`setting.GDN_MODELS`: 48 Gated
DeltaNet and 16 gated attention layers, configs/qwen3_5_27b_fast_dllm_v2_256k.py's
dimensions) and diffusiongemma-26b-a4b (the released Gemma 4
layers of configs/diffusiongemma_26b_a4b_sft_256k.py; with `--objective diffusiongemma`).

An MoE preset splits its experts over the seq axis (`parallel.expert_axes=seq`). XLA:CPU
compiles neither the GPU's dispatch (`ragged-all-to-all`) nor a grouped matmul (jax lowers
`ragged_dot` there as a dense matmul over every local expert's masked copy of the rows), so
each MoE setting is compiled twice: the real step with `parallel.moe_dispatch=all_gather`
(which gathers the group's tokens; most of its memory on CPU is that dense `ragged_dot`),
and the ragged dispatch with shape-faithful stand-ins (`_ragged_standins`: the same
buffers, not the same FLOPs or collectives), the latter being the figure the cost model
reads. `--dispatch real` compiles the ragged dispatch with the model's own `ragged_dot` and
`ragged_all_to_all` instead (its rows carry the override `RAGGED`), which an accelerator
compiler builds (XLA:TPU does) and XLA:CPU refuses, row by row. The markdown puts them next
to the cost model's analytic figure for the ragged path.

`--objective dflash` (docs/dflash.md) compiles a drafter's step instead: the model is
the frozen target (its causal forward over the L context rows, no backward), and a
`--drafter-layers` drafter (the target's widths) trains on `--anchors` draft blocks of
`--block-size` rows; only the drafter has optimiser state. It writes scale_probe_dflash.*.
"""

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import os
import runpy
import sys

import jax

from bdlm_jax.analysis import buffers, isolated, step_report, targets
from bdlm_jax.analysis.cost_model import setting
from bdlm_jax.analysis.cost_model.memory import RAGGED_DISPATCH, peak_memory
from bdlm_jax.analysis.cost_model.work import plan_work
from bdlm_jax.analysis.results import core_version, produced, write_results_pages
from bdlm_jax.config import REMAT, Config, ModelConfig
from bdlm_jax.configure import override, replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.metrics import param_count
from bdlm_jax.models.drafter import target_layer_ids
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.registry import SINGLE_DEVICE, strategy_names, strategy_names_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
GB = step_report.GB
MODELS = {
    "llama3-8b": setting.MODELS["llama3-8b"],
    "qwen3-8b": ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, d_ff=12288, rope_theta=1e6,
                            qk_norm=True, tie_embeddings=False),
    "gemma3-27b": setting.MODELS["gemma3-27b"],
    "qwen3-30b-a3b": setting.MODELS["qwen3-30b-a3b"],
    "qwen3.5-27b": setting.GDN_MODELS["qwen3.5-27b"],
    # the released dimensions, as the recipe's config names their source
    "diffusiongemma-26b-a4b": ModelConfig(**runpy.run_path(os.path.join(
        ROOT, "configs", "diffusiongemma_26b_a4b_sft_256k.py"))["DIFFUSIONGEMMA_26B_A4B"],
                                          compute_dtype="bfloat16"),
    "tiny": ModelConfig(vocab_size=260, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=64, attention_chunk=32),
}
STRATEGIES = strategy_names(splits_sequences=True)
# --quick: 32 tokens are 2 blocks, fewer than 4 ranks, so bp and csbp are rejected there.
QUICK = dict(models=["tiny"], lens=[32, 64], devices=4, block_size=16, depth_check=1,
             device_memory_gb=0.01, anchors=4)
KEYS = ("model", "seq_len", "strategy", "devices", "layers", "block_size", "remat", "overrides",
        "standins", "objective", "anchors", "drafter_layers", "target")
# An MoE's experts over the seq axis, its rows moved by a dispatch XLA:CPU compiles.
EXPERT_PARALLEL = ("parallel.expert_axes=seq", "parallel.moe_dispatch=all_gather")
RAGGED = (RAGGED_DISPATCH,)  # the GPU's (and TPU's) dispatch
# --ablate: (what changes, config overrides) against the defaults of `probe_config`. The
# state sharding (ZeRO-3 over fsdp x seq) and the layer scan have no switch: their effect is
# in the arguments column and in the depth check of the main table.
ABLATIONS = (
    ("every feature on", ()),
    ("remat off (model.remat=none)", ("model.remat=none",)),
    ("loss over all rows at once (model.logits_chunk=0)", ("model.logits_chunk=0",)),
    ("f32 compute: f32 weights gathered, f32 K/V on the wire (model.compute_dtype=float32)",
     ("model.compute_dtype=float32",)),
    ("option: bf16 dK/dV on the wire (parallel.kv_grad_dtype=bfloat16)",
     ("parallel.kv_grad_dtype=bfloat16",)),
)


def probe_config(model: str, seq_len: int, strategy: str, devices: int, layers: int,
                 block_size: int, remat: str, overrides=(), standins: bool = False,
                 objective: str = "bd3lm", anchors: int = 0, drafter_layers: int = 0) -> Config:
  """One sequence of `seq_len` tokens over a seq axis of `devices`; bf16 compute; an MoE's
  experts split over that axis (`EXPERT_PARALLEL`; with `standins` the ragged dispatch);
  then `overrides` (`--set` syntax). `objective=dflash`: `model` is the frozen target of a
  `drafter_layers`-layer drafter trained on `anchors` draft blocks."""
  m = dataclasses.replace(MODELS[model], n_layers=layers, remat=remat,
                          compute_dtype="bfloat16", param_dtype="float32")
  drafter = objective == "dflash"
  cfg = replace(Config(), model=m, data=dict(seq_len=seq_len),
                objective=dict(name=objective, block_size=block_size,
                               mask_token_id=m.vocab_size - 1,
                               **(dict(max_anchors=anchors) if drafter else {}),
                               **(dict(loss_weight="unit") if objective == "diffusiongemma"
                                  else {})),
                drafter=dict(n_layers=drafter_layers) if drafter else {},
                parallel=dict(strategy=strategy, seq=devices), train=dict(batch_size=1))
  moe = (*EXPERT_PARALLEL, *(RAGGED if standins else ()))
  return override(cfg, (*(moe if m.moe_experts else ()), *overrides))


def _ragged_standins() -> None:
  """Replaces the ragged ops XLA:CPU cannot compile by stand-ins with their buffers: a plain
  matmul with the first expert's weights for `ragged_dot` (the rows of a grouped matmul,
  [N, K] x [K, F] -> [N, F]; its weight gradient fills the [E, K, F] buffer as a grouped
  one does), and a local copy into the output buffer for `ragged_all_to_all`. Memory only:
  FLOPs and collectives of such a compile are not the step's. The check that refuses the
  ragged dispatch on CPU (`targets.check`) stands aside for them."""
  def ragged_dot(lhs, rhs, group_sizes, **_):
    return lhs @ rhs[0]

  def ragged_all_to_all(operand, output, *_, **__):
    n = min(operand.shape[0], output.shape[0])
    return jax.lax.dynamic_update_slice(output, operand[:n], (0, 0))

  jax.lax.ragged_dot, jax.lax.ragged_all_to_all = ragged_dot, ragged_all_to_all
  targets.check_dispatch_runs_here = lambda *_: None


def job_config(job: dict) -> Config:
  """`probe_config` of a job (its target and breakdown aside)."""
  return probe_config(**{k: v for k, v in job.items() if k not in ("target", "breakdown")})


def measure(job: dict, timeout_s: float) -> dict:
  """The report row of one compile, run in a fresh process, or {'error': why not}."""
  try:
    if not job["standins"]:  # stand-ins replace what the check refuses (_ragged_standins)
      targets.check(job_config(job), targets.platform_of(job["target"]))
  except ConfigError as e:
    return dict(error=str(e))
  return isolated.run_worker(__file__, job, job["devices"], job["target"], timeout_s)


def _worker(job: dict) -> None:
  if job["standins"]:
    _ragged_standins()
  try:
    cfg = job_config(job)
    mesh = make_mesh(cfg, targets.resolve(job["target"], job["devices"]).devices)
    if job.get("breakdown"):
      report, breakdown = buffers.step_breakdown(cfg, mesh)
      row = dict(report.row(), breakdown="\n".join(breakdown.lines()))
    else:
      row = step_report.step_report(cfg, mesh).row()
  except ConfigError as e:
    row = dict(error=str(e))
  except Exception as e:  # noqa: BLE001 (a strategy that does not compile is a finding)
    row = dict(error=f"compile failed: {type(e).__name__}: {str(e).splitlines()[0]}")
  print(json.dumps(row))


def jobs(args) -> list[dict]:
  """Every (model, L, strategy) at full depth, then each model's depth check; with
  `--ablate`, every (strategy, ablation) of the first model and L instead."""
  out, checks = [], []
  for model in args.models:
    job = lambda seq_len, strategy, layers, overrides=(), standins=False: dict(
        model=model, seq_len=seq_len, strategy=strategy, devices=args.devices, layers=layers,
        block_size=args.block_size, remat=args.remat, overrides=[*args.set, *overrides],
        standins=standins, objective=args.objective,
        anchors=args.anchors if args.objective == "dflash" else 0,
        drafter_layers=args.drafter_layers if args.objective == "dflash" else 0,
        target=args.target)
    layers = args.layers or MODELS[model].n_layers
    if args.ablate:
      return [dict(job(args.lens[0], s, layers, overrides), variant=label)
              for s in args.strategies for label, overrides in ABLATIONS]
    ragged = dict(standins=True) if args.dispatch == "standins" else dict(overrides=RAGGED)
    variants = ({}, ragged) if MODELS[model].moe_experts else ({},)
    out += [job(n, s, layers, **v) for n in args.lens for s in args.strategies
            for v in variants]
    if args.depth_check and args.depth_check != layers:
      checks.append(dict(job(args.lens[0], args.strategies[0], args.depth_check),
                         depth_check=True))
  return out + checks


def run(args, progress=print) -> list[dict]:
  """Measures every job, `args.jobs` compiles at a time, in order."""
  todo = jobs(args)
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    results = pool.map(lambda j: measure(dict({k: j[k] for k in KEYS},
                                              breakdown=args.breakdown), args.timeout), todo)
    rows = []
    for job, result in zip(todo, results):
      rows.append(dict(job, **result))
      progress(_line(rows[-1]))
      if rows[-1].get("breakdown"):
        progress(rows[-1]["breakdown"])
  return rows


def breakdown_markdown(rows: list[dict], command: str) -> str:
  """`--breakdown`: each row's buffers live at the peak, under its setting."""
  lines = ["## Memory at the peak by category (compile only)", "", f"{produced(command)}", ""]
  for r in rows:
    lines += [f"### {_line(r)}", "", r.get("breakdown") or r.get("error", ""), ""]
  return "\n".join(lines)


def _line(r: dict) -> str:
  head = (f"{r['model']} L={r['seq_len']} {r['strategy']} ({r['layers']} layers"
          f"{', ragged stand-ins' if r.get('standins') else ''}"
          f"{''.join(', ' + o for o in r.get('overrides') or [])}): ")
  if r.get("error"):
    return head + r["error"]
  return head + (f"peak {r['peak_bytes'] / GB:.2f} GB, attention {r['attention_bytes'] / GB:.2f}"
                 f" GB/step, compiled in {r['compile_s']:.1f} s")


def markdown(rows: list[dict], args, device_bytes: float, command: str) -> str:
  drafter = args.objective == "dflash"
  title = "A DFlash drafter's step" if drafter else "Compiled memory"
  compiler = "" if args.target == "cpu" else f", XLA:{targets.platform_of(args.target).upper()}"
  lines = [f"## {title} at scale (per device, compile only{compiler})", "",
           f"{produced(command)} {args.compiled_on} on the seq axis, one "
           f"sequence per step, block size {args.block_size}, bf16 compute, f32 parameters, remat "
           f"`{args.remat}`. {step_report.peak_note(rows)}"
           f"{_CPU_NOTE if args.target == 'cpu' else ''}. *attention GB/step*: K/V, dK/dV "
           "and row metadata each device sends per step, from the layout plan (ring-algorithm "
           "wire bytes, bf16 K/V, f32 dK/dV); *attention check*: compiled attention "
           "collectives ÷ the plan's (1.00: the core moves what its transport should).", ""]
  if drafter:
    lines += [_DRAFTER_NOTE, ""]
  for model in args.models:
    lines += model_section(rows, model, args, device_bytes)
  return "\n".join(lines)


_CPU_NOTE = " (XLA:CPU figures: the structure to optimise, not a GPU's exact bytes)"
_DRAFTER_NOTE = (
    "Objective dflash: each model below is the *frozen target*, run causally forward only over "
    "the L context rows (its parameters are ZeRO-3-sharded arguments, with no gradient and no "
    "optimiser state); the drafter (the target's widths, q/k norm) trains forward + backward on "
    "the draft blocks, its keys the draft rows and the context. Attention bytes: the target's "
    "context K/V forward (cp_* and csbp_* move every context row; bp replicates the context) "
    "plus the drafter's K/V forward and dK/dV back (cp_*: draft + context rows; csbp_*: the "
    "context only).")


def _params(m: ModelConfig) -> str:
  if not m.moe_experts:
    return f"{param_count(m) / 1e9:.2f}B parameters"
  return (f"{param_count(m) / 1e9:.2f}B parameters ("
          f"{param_count(m, active=True) / 1e9:.2f}B active: router and "
          f"{m.moe_top_k} of {m.moe_experts} experts of width {m.moe_d_ff} per token)")


def model_section(rows: list[dict], model: str, args, device_bytes: float) -> list[str]:
  """One model's table (the real step), best pick per L and depth check; for an MoE also
  the ragged dispatch's stand-in compile and the cost model's analytic figure."""
  m = MODELS[model]
  mine = _real_step_rows(rows, model)
  lines = [f"### {model}", "",
           f"{_params(m)}: d_model {m.d_model}, {mine[0]['layers']} layers, {m.n_heads} q / "
           f"{m.n_kv_heads} kv heads of {m.head_dim}, d_ff {m.moe_d_ff or m.d_ff}, vocab "
           f"{m.vocab_size}, qk_norm {m.qk_norm}, tied embeddings {m.tie_embeddings}.", ""]
  if args.objective == "dflash":
    lines += [_drafter_line(model, mine[0]), ""]
  if m.moe_experts:
    lines += [f"Experts split over the {args.devices} seq devices "
              f"({m.moe_experts // args.devices} each, `parallel.expert_axes=seq`), capacity "
              f"{m.moe_capacity_factor}x a fair share (`model.moe_drop_tokens`); the table: "
              "the real step with `parallel.moe_dispatch=all_gather`.", ""]
  lines += step_report.table(mine, device_bytes, keys=("seq_len", "strategy")) + [""]
  for seq_len in sorted({r["seq_len"] for r in mine}):
    best = step_report.choose([r for r in mine if r["seq_len"] == seq_len], device_bytes)
    lines.append(f"* L = {seq_len}: " + (f"{best['strategy']} fits with the least attention "
                                         "traffic" if best else "no strategy fits"))
  for check in (r for r in rows if r["model"] == model and r.get("depth_check")):
    full = next(r for r in mine if r["seq_len"] == check["seq_len"]
                and r["strategy"] == check["strategy"])
    if check.get("error") or full.get("error"):
      lines.append(f"* depth check: {check.get('error') or full.get('error')}")
      continue
    lines.append(f"* compile time, {check['strategy']} at L = {check['seq_len']}: "
                 f"{full['compile_s']:.1f} s at {full['layers']} layers vs "
                 f"{check['compile_s']:.1f} s at {check['layers']} "
                 f"({full['compile_s'] / check['compile_s']:.2f}x)")
  if m.moe_experts:
    lines += [""] + _dispatch_table(rows, model, args, device_bytes)
  return lines + [""] + _beside_cpu(mine, args, device_bytes)


def _beside_cpu(mine: list[dict], args, device_bytes: float) -> list[str]:
  """Each compiled setting next to XLA:CPU's figure of the same setting (the scale_probe.csv
  of the same --out folder), with the ratio and both verdicts against this target's device
  memory: what a table of simulated CPU devices would have concluded."""
  path = os.path.join(args.out, _table_name(args, "cpu") + ".csv")
  if args.target == "cpu" or not os.path.exists(path):
    return []
  cpu = {_identity(r): r for r in _real_step_rows(read(path), mine[0]["model"])}
  pairs = [(r, cpu.get(_identity(dict(r, target="cpu")))) for r in mine]
  pairs = [(r, c) for r, c in pairs if c is not None and not c.get("error")]
  if not pairs:
    return []
  gb = step_report.format_gb
  fits = lambda nbytes: "yes" if nbytes <= device_bytes else "no"
  lines = [f"Beside XLA:CPU (the same setting on {args.devices} simulated CPU devices, "
           f"{os.path.basename(path)}; XLA:CPU reports no peak of its own, its figure is the "
           "bound). A verdict that differs is in bold.", "",
           "| seq_len | strategy | this peak GB | this bound GB | XLA:CPU GB | peak / XLA:CPU | "
           f"fits {device_bytes / GB:g} GB: XLA:CPU, this |", "|" + "---|" * 7]
  for r, c in pairs:
    if r.get("error"):
      ours, ratio, verdict = ("does not compile", "—"), "—", "no"
    else:
      ours = (gb(r["peak_bytes"]), gb(r.get("bound_bytes") or r["peak_bytes"]))
      ratio, verdict = f"{r['peak_bytes'] / c['peak_bytes']:.2f}", fits(r["peak_bytes"])
    verdicts = f"{fits(c['peak_bytes'])}, {verdict}"
    if fits(c["peak_bytes"]) != verdict:
      verdicts = f"**{verdicts}**"
    lines.append(f"| {r['seq_len']} | {r['strategy']} | {ours[0]} | {ours[1]} | "
                 f"{gb(c['peak_bytes'])} | {ratio} | {verdicts} |")
  return lines + [""]


def _drafter_line(model: str, row: dict) -> str:
  """What a dflash run trains over `model`, from one of its rows (as written or as read)."""
  ints = {k: int(row[k]) for k in ("seq_len", "layers", "block_size", "anchors",
                                   "drafter_layers")}
  try:
    cfg = probe_config(model, ints["seq_len"], SINGLE_DEVICE, 1, ints["layers"], ints["block_size"],
                       row["remat"], objective="dflash", anchors=ints["anchors"],
                       drafter_layers=ints["drafter_layers"])
  except ConfigError as e:
    return f"Trained: a drafter this setting rejects ({e})."
  return (f"Trained: {step_report.describe_objective(cfg)}, draft blocks of "
          f"{cfg.objective.block_size}; its context: the target's outputs at layers "
          f"{', '.join(map(str, target_layer_ids(cfg)))}.")


def _real_step_rows(rows: list[dict], model: str) -> list[dict]:
  """`model`'s rows of the step as configured: no depth check, no other MoE dispatch."""
  return [r for r in rows if r["model"] == model and not r.get("depth_check")
          and not r.get("standins") and RAGGED_DISPATCH not in (r.get("overrides") or [])]


def _dispatch_table(rows: list[dict], model: str, args, device_bytes: float) -> list[str]:
  """Peak GB per device of the MoE step by dispatch: compiled all_gather, compiled ragged
  with stand-ins and with its own ops (`--dispatch real`), and the cost model's analytic
  ragged figure."""
  ours = [r for r in rows if r["model"] == model and not r.get("depth_check")]
  m = dataclasses.replace(MODELS[model], n_layers=ours[0]["layers"])
  hw = setting.Hardware(nodes=1, gpus_per_node=args.devices)
  gb = lambda r: "—" if r is None or r.get("error") else f"{r['peak_bytes'] / GB:.2f}"
  dense = (", inflated by jax's CPU `ragged_dot`, a dense matmul over each local expert's "
           "masked copy of the rows (no grouped matmul on XLA:CPU)" if args.target == "cpu"
           else "")
  lines = [f"Peak GB per device by token dispatch. *all_gather*: the table above{dense}. "
           "*ragged, stand-ins*: "
           "`parallel.moe_dispatch=ragged_all_to_all`, the GPU's, compiled with shape-faithful "
           "stand-ins for `ragged_all_to_all` (XLA:CPU cannot compile it) and `ragged_dot`: "
           "the ragged path's buffers. *ragged*: the same dispatch with its own ops "
           "(`--dispatch real`), where the compiler builds it (not XLA:CPU). *analytic*: the "
           "cost model's assumption for the ragged path (states + saved layer inputs and "
           "attention outputs + one layer's backward), which reads about half of XLA:CPU's "
           "figure for the dense models.", "",
           "| seq_len | strategy | all_gather GB | ragged, stand-ins GB | ragged GB | "
           f"analytic GB | ragged fits {device_bytes / GB:g} GB |", "|" + "---|" * 7]
  for real in _real_step_rows(rows, model):
    same = lambda r: (r["seq_len"], r["strategy"]) == (real["seq_len"], real["strategy"])
    stand = next((r for r in ours if r.get("standins") and same(r)), None)
    ragged = next((r for r in ours if RAGGED_DISPATCH in r["overrides"] and same(r)), None)
    work = plan_work(real["strategy"], real["seq_len"], args.block_size, args.devices)
    analytic = peak_memory(m, work, hw, setting.Assumptions())["total_bytes"]
    decides = ragged if gb(ragged) != "—" else stand
    fits = "—" if gb(decides) == "—" else ("yes" if decides["peak_bytes"] <= device_bytes
                                           else "**no**")
    lines.append(f"| {real['seq_len']} | {real['strategy']} | {gb(real)} | {gb(stand)} | "
                 f"{gb(ragged)} | {analytic / GB:.2f} | {fits} |")
  return lines


def ablation_markdown(rows: list[dict], args, command: str) -> str:
  """What each memory feature buys: every ablation next to every feature on."""
  r0 = rows[0]
  lines = ["## What each memory feature buys (compile only)", "",
           f"Produced by `{command}`, core version {core_version()}: {r0['model']}, L = "
           f"{r0['seq_len']}, {args.compiled_on} on the seq axis, block size "
           f"{args.block_size}, {r0['layers']} layers; each row changes one thing against the "
           "first (bf16 compute, f32 parameters, remat `full`, loss in row chunks, ZeRO-3 "
           "state over fsdp x seq). GB per device; *attention GB/step* from the layout plan "
           "at the wire dtypes of the row.", "",
           "| strategy | change | arguments GB | temp GB | peak GB | ÷ every feature on | "
           "attention GB/step | compile s |", "|---|---|---|---|---|---|---|---|"]
  for strategy in args.strategies:
    mine = [r for r in rows if r["strategy"] == strategy]
    base = next((r for r in mine if not r["overrides"] and not r.get("error")), None)
    for r in mine:
      if r.get("error"):
        lines.append(f"| {strategy} | {r['variant']} | not run: {r['error']} |||||||")
        continue
      ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" if base else "—"
      lines.append(f"| {strategy} | {r['variant']} | {r['argument_bytes'] / GB:.2f} | "
                   f"{r['temp_bytes'] / GB:.2f} | {r['peak_bytes'] / GB:.2f} | {ratio} | "
                   f"{r['attention_bytes'] / GB:.2f} | {r['compile_s']:.1f} |")
  return "\n".join(lines + [""])


def plot(rows: list[dict], args, device_bytes: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(args.models), figsize=(5 * len(args.models), 3.8),
                           squeeze=False)
  for ax, model in zip(axes[0], args.models):
    for i, strategy in enumerate(args.strategies):
      pts = [(r["seq_len"], r["peak_bytes"] / GB) for r in _real_step_rows(rows, model)
             if r["strategy"] == strategy and not r.get("error")]
      if pts:
        ax.plot(*zip(*sorted(pts)), marker="o", label=strategy, color=f"C{i}")
    ax.axhline(device_bytes / GB, color="k", linestyle="--", linewidth=1,
               label=f"{device_bytes / GB:g} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("peak GB per device (compiled)")
    ax.set_title(f"{model}, {args.devices} devices")
    ax.grid(alpha=0.3)
  # one legend for every panel (a strategy missing from the last panel still gets its line)
  handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
  fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 7),
             fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


TEXT = ("model", "strategy", "remat", "overrides", "objective", "variant", "error", "standins",
        "depth_check", "target")  # the CSV's other columns are numbers


def read(path: str) -> list[dict]:
  """The rows `write` wrote, parsed as `run` returns them."""
  number = lambda v: None if v == "" else int(v) if v.lstrip("-").isdigit() else float(v)
  with open(path) as f:
    rows = list(csv.DictReader(f))
  for r in rows:
    r.update({k: number(v) for k, v in r.items() if k not in TEXT})
    r.update(overrides=r["overrides"].split(), objective=r.get("objective") or "bd3lm",
             target=r.get("target") or "cpu",
             anchors=r.get("anchors") or 0, drafter_layers=r.get("drafter_layers") or 0,
             standins=r.get("standins") == "True", depth_check=r.get("depth_check") == "True"
             or "")
  return rows


def _identity(r: dict) -> tuple:
  """What a row measured (its job, ablation variant, depth check), alike for a row `run`
  returns and one `read` back."""
  job = tuple(str(r.get(k, "")) for k in KEYS if k not in ("overrides", "standins"))
  return (*job, tuple(r["overrides"]), bool(r.get("standins")), r.get("variant") or "",
          bool(r.get("depth_check")))


def merge(earlier: list[dict], rows: list[dict]) -> list[dict]:
  """`earlier` rows with those that `rows` re-measured replaced in place, then the new ones:
  a run of a few models, lengths or strategies updates the table it writes into."""
  fresh = {_identity(r): r for r in rows}
  return [fresh.pop(_identity(r), r) for r in earlier] + list(fresh.values())


def _check_same_setting(rows: list[dict], args, path: str) -> None:
  """One table states one setting in its header: rows of another cannot join it."""
  keys = ("devices", "block_size", "remat", "target") + (("model", "seq_len") if args.ablate
                                                         else ())
  settings = {tuple(r[k] for k in keys) for r in rows}
  if len(settings) > 1:
    raise SystemExit(f"{path}.csv holds rows of another {', '.join(keys)} than this run's: "
                     f"pass --out to write this run beside it")


def _splice(old: str, model: str, section: str) -> str:
  """`old` markdown with `model`'s section replaced by `section`, or `section` appended."""
  head, *parts = old.split("\n### ")
  parts = [f"### {x}".rstrip("\n") for x in parts]
  at = next((i for i, x in enumerate(parts) if x.startswith(f"### {model}\n")), len(parts))
  parts[at:at + 1] = [section.rstrip("\n")]
  return "\n\n".join([head.rstrip("\n"), *parts]) + "\n"


def write(rows: list[dict], path: str) -> None:
  columns = list(KEYS) + ["variant", "depth_check", "error"]
  columns += [k for r in rows for k in r if k not in columns]
  columns = list(dict.fromkeys(columns))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(dict(r, overrides=" ".join(r["overrides"])) for r in rows)


def _table_name(args, target: str) -> str:
  """The files' name (without suffix) of a run of `args` compiled for `target`."""
  return "".join(["scale_probe", "_quick" if args.quick else "",
                  "" if target == "cpu" else f"_{targets.platform_of(target)}",
                  "_dflash" if args.objective == "dflash" else "",
                  "_ablation" if args.ablate else ""])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-8b", "gemma3-27b"],
                      choices=sorted(MODELS))
  parser.add_argument("--lens", nargs="+", type=int,
                      default=[65536, 131072, 262144, 524288, 1048576])
  parser.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                      help="default: every one that can train --objective")
  parser.add_argument("--devices", type=int, default=16, help="P: the seq axis")
  parser.add_argument("--block-size", type=int, default=64)
  parser.add_argument("--layers", type=int, default=0, help="override every model's depth")
  parser.add_argument("--remat", default="full", choices=REMAT)
  parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                      help="config overrides for every compile (run.py's --set syntax), e.g. "
                           "model.row_chunks=16")
  parser.add_argument("--device-memory-gb", type=float, default=0.0,
                      help="per device; 0: the target's (a TPU chip's HBM, what a GPU reports), "
                           "else 141 (an H200)")
  parser.add_argument("--target", default="cpu",
                      help="the compiler: cpu, tpu:<topology> (e.g. tpu:v5p:2x2x4; needs "
                           "libtpu) or gpu (bdlm_jax.analysis.targets)")
  parser.add_argument("--breakdown", action="store_true",
                      help="also each compile's buffers live at its peak, by category")
  parser.add_argument("--dispatch", default="standins", choices=("standins", "real"),
                      help="an MoE's ragged dispatch: with shape-faithful stand-ins (XLA:CPU "
                           "compiles them) or its own ragged_dot / ragged_all_to_all")
  parser.add_argument("--depth-check", type=int, default=4,
                      help="also compile the first (L, strategy) at this depth (0: off)")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per compile")
  parser.add_argument("--jobs", type=int, default=1,
                      help="compiles at once (more than 1 inflates each one's compile time)")
  parser.add_argument("--quick", action="store_true", help="a tiny model (tests)")
  parser.add_argument("--ablate", action="store_true",
                      help="one compile per ABLATIONS entry at the first model and L")
  parser.add_argument("--objective", default="bd3lm",
                      choices=("bd3lm", "dflash", "diffusiongemma"),
                      help="dflash: each model is the frozen target of a trained drafter; "
                           "diffusiongemma: a model with self-conditioning "
                           "(diffusiongemma-26b-a4b)")
  parser.add_argument("--anchors", type=int, default=512,
                      help="dflash: objective.max_anchors, draft blocks per sequence")
  parser.add_argument("--drafter-layers", type=int, default=5, help="dflash: drafter.n_layers")
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return _worker(json.loads(args.worker))
  args.strategies = args.strategies or list(strategy_names_for(args.objective,
                                                                splits_sequences=True))
  if args.quick:  # the tiny setting, keeping --lens if given
    vars(args).update({k: v for k, v in QUICK.items()
                       if k != "lens" or args.lens == parser.get_default("lens")})
  name = _table_name(args, args.target)
  command = ("python experiments/scale_probe.py "
             + " ".join(sys.argv[1:] if argv is None else argv)).strip()
  try:
    target = targets.resolve(args.target)
  except ConfigError as e:
    raise SystemExit(f"--target {args.target}: {e}") from e
  device_bytes = step_report.device_memory_bytes(args.device_memory_gb, target)
  args.compiled_on = (f"{args.devices} simulated CPU devices" if args.target == "cpu" else
                      f"{args.devices} devices: {target.describe(args.devices)}")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, name)
  fresh = run(args)
  if args.breakdown:
    with open(f"{path}_breakdown.md", "w") as f:
      f.write(breakdown_markdown(fresh, command))
    fresh = [{k: v for k, v in r.items() if k != "breakdown"} for r in fresh]
  rows = merge(read(f"{path}.csv") if os.path.exists(f"{path}.csv") else [], fresh)
  _check_same_setting(rows, args, path)
  measured = args.models
  args.models = list(dict.fromkeys(r["model"] for r in rows))
  args.strategies = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
  if args.ablate:
    text = ablation_markdown(rows, args, command)
  elif len(rows) > len(fresh) and os.path.exists(f"{path}.md"):
    with open(f"{path}.md") as f:
      text = f.read()
    for model in measured:  # the other sections stay as the earlier runs wrote them
      section = model_section(rows, model, args, device_bytes)
      section.insert(2, f"{produced(command)} This section: these rows merged into the "
                     "earlier ones (a row measured again replaces its figures); the setting as "
                     "above.\n")
      text = _splice(text, model, "\n".join(section))
  else:
    text = markdown(rows, args, device_bytes, command)
  print(text)
  write(rows, f"{path}.csv")
  with open(f"{path}.md", "w") as f:
    f.write(text)
  if not args.ablate:
    plot(rows, args, device_bytes, f"{path}.png")
  write_results_pages(args.out)
  return rows


if __name__ == "__main__":
  main()
