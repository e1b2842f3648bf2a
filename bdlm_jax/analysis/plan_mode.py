"""mode=plan: the train step compiled under every strategy (`step_report`), each one's step
time projected by the cost model, and the fastest that fits.

Fit is what `plan.target`'s compiler allocates in the device's own memory (XLA's buffer
assignment: `step_report.fit_bytes`; host-resident buffers apart) against a TPU chip's HBM or
an H200's 141 GB, with the compiler's own peak (XLA:TPU) or bound (XLA:CPU) beside it; time
is the cost model's (`cost_model.timing`, `cost_model.dflash` for a drafter) on the
strategy's own plan, on H200s whatever the target, as many as the mesh has, under the
default assumptions in the config's dtypes and remat. Least attention traffic is not the
pick: `bp` sends nothing but repeats the clean prefix on every rank, and whether that costs
more than the K/V hops it saves depends on the sizes.

On one seq rank (`parallel.seq=1`) nothing splits a sequence: every strategy is the
single-device `none`, compiled once. (`bp` would be projected, and compile, a little cheaper
there: its plan leaves out the last block's clean rows, which no noisy block reads and no
label sits on (`LayoutPlan.counted_rows`), while `none` lays out all 2L rows.)
"""

import dataclasses

import jax.numpy as jnp

from bdlm_jax.analysis import buffers, step_report, targets
from bdlm_jax.analysis.cost_model.dflash import dflash_step_time, dflash_works
from bdlm_jax.analysis.cost_model.setting import GB, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.timing import step_time
from bdlm_jax.analysis.cost_model.work import work_of
from bdlm_jax.analysis.step_report import fit_of
from bdlm_jax.config import Config
from bdlm_jax.configure import override
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.registry import SINGLE_DEVICE, plan_for, strategy_names_for

# What a batch of S sequences divides by S: each FLOP and byte S times, each hop's latency once.
RATES = ("matmul_tflops", "attention_tflops", "delta_rule_tflops", "nvlink_gb_s", "ib_gb_s")


def mesh_hardware(num_devices: int, hw: Hardware = Hardware()) -> Hardware:
  """`hw`'s GPUs and links, in as many nodes as `num_devices` fill (one, if fewer than a
  node's GPUs): a ring within a node runs on NVLink, across nodes on InfiniBand."""
  per_node = min(num_devices, hw.gpus_per_node)
  nodes = -(-num_devices // per_node)
  name = f"{nodes * per_node}x H200 ({nodes} node{'s' * (nodes > 1)} x {per_node})"
  return dataclasses.replace(hw, name=name, nodes=nodes, gpus_per_node=per_node)


def assumptions(cfg: Config) -> Assumptions:
  """The cost model's defaults, in `cfg`'s compute and dK/dV dtypes and remat."""
  itemsize = lambda dtype: jnp.dtype(dtype).itemsize
  return dataclasses.replace(Assumptions(), compute_bytes=itemsize(cfg.model.compute_dtype),
                             kv_grad_bytes=itemsize(cfg.parallel.kv_grad_dtype),
                             remat_forward=int(cfg.model.remat != "none"))


def sequences(cfg: Config) -> int:
  """Sequences one device runs at once: its share of a micro-batch (`mesh.check_config`),
  times the objective's copies."""
  p, t = cfg.parallel, cfg.train
  copies = get_objective(cfg.objective.name).COPIES
  return t.batch_size // (p.data * p.fsdp * t.grad_accum) * copies


def batched(hw: Hardware, cfg: Config) -> Hardware:
  """`hw` at 1/S of every rate, S = `sequences(cfg)`: a batch timed as one sequence."""
  s = sequences(cfg)
  return dataclasses.replace(hw, **{rate: getattr(hw, rate) / s for rate in RATES})


def projected_step(cfg: Config, hw: Hardware, a: Assumptions) -> dict:
  """Seconds of `cfg`'s train step per device under its strategy: `compute_s` on the busiest
  rank, `wait_s` the rest (K/V hops not hidden, waiting for ring neighbours, an MoE's token
  exchange). A micro-batch's sequences run as one batch: as one sequence at 1/S of every rate."""
  batch = batched(hw, cfg)
  if get_objective(cfg.objective.name).DRAFTER:
    t = dflash_step_time(cfg, *dflash_works(cfg.parallel.strategy, cfg, cfg.parallel.seq),
                         batch, a)
    compute = sum(t[f"{who}_{part}_s"] for who in ("target", "drafter")
                  for part in ("linear", "attention_busy"))
  else:
    t = step_time(cfg.model, work_of(plan_for(cfg)), batch, a)
    compute = t["linear_s"] + t["attention_busy_s"] + t["gdn_busy_s"]
  steps = cfg.train.grad_accum
  return dict(total_s=steps * t["total_s"], compute_s=steps * compute,
              wait_s=steps * (t["total_s"] - compute))


def fastest_that_fit(rows: list[dict], device_bytes: float) -> list[dict]:
  """The rows that compiled and fit `device_bytes`, least projected time (then peak) first."""
  fit = [r for r in rows if not r.get("error") and fit_of(r) <= device_bytes]
  return sorted(fit, key=lambda r: (r["total_s"], fit_of(r)))


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g} ms"


def _memory(row: dict, compiler: str) -> str:
  """A row's device figure and the compiler's: '30.2 GB on the device (XLA:TPU peak 37.6
  GB)'."""
  figure = "bound" if row.get("compiler_peak_bytes") is None else "peak"
  return (f"{fit_of(row) / GB:.3g} GB on the device ({compiler} {figure} "
          f"{row['peak_bytes'] / GB:.3g} GB)")


def verdict(rows: list[dict], device_bytes: float, where: str, compiler: str) -> list[str]:
  """`chosen: <strategy> (...)` with why and the `compiler`'s figure it fits by, the
  runner-up, and any faster strategy that does not fit (a larger device would pick it)."""
  ranked = fastest_that_fit(rows, device_bytes)
  limit = f"{device_bytes / GB:g} GB"
  if not ranked:
    return [f"chosen: none (no strategy fits {limit} per device by what {compiler} allocates "
            "on it)"]
  best = ranked[0]
  fits = f"fits: {_memory(best, compiler)} of {limit}"
  if len(ranked) == 1:
    lines = [f"chosen: {best['strategy']} (projected {_ms(best['total_s'])}/step {where}; "
             f"{fits}, the only strategy {'that does' if len(rows) > 1 else 'compiled'})",
             "runner-up: none"]
  else:
    second = ranked[1]
    gap = lambda key: second[key] - best[key]  # what the runner-up spends beyond the pick
    less = lambda d: f"{_ms(abs(d))} {'less' if d >= 0 else 'more'}"
    lines = [f"chosen: {best['strategy']} (projected {_ms(best['total_s'])}/step {where}; "
             f"{fits}; the fastest of the {len(ranked)} that fit: {less(gap('wait_s'))} K/V "
             f"transfer and waiting than the runner-up, {less(gap('compute_s'))} compute)",
             f"runner-up: {second['strategy']} (projected {_ms(second['total_s'])}/step, "
             f"{second['total_s'] / best['total_s']:.3g}x)"]
  over = [f"{r['strategy']} ({_ms(r['total_s'])}/step, {_memory(r, compiler)})"
          for r in rows if not r.get("error") and fit_of(r) > device_bytes
          and r["total_s"] < best["total_s"]]
  return lines + ([f"faster but over {limit}: {', '.join(over)}"] if over else [])


def describe(hw: Hardware, a: Assumptions) -> str:
  """The hardware and the assumptions that move a strategy's time, for the report."""
  return (f"{hw.name}: {hw.matmul_tflops:g} TFLOP/s GEMM, {hw.attention_tflops:g} TFLOP/s "
          f"attention, NVLink {hw.nvlink_gb_s:g} GB/s + {hw.nvlink_alpha_us:g} us a hop, "
          f"InfiniBand {hw.ib_gb_s:g} GB/s + {hw.ib_alpha_us:g} us; the default assumptions in "
          "the config's dtypes and remat: "
          f"{'' if a.tile_skipping else 'no '}tile skipping, ring hops "
          f"{'hidden under' if a.ring_overlap else 'before'} compute, backward "
          f"{a.attention_bwd_factor:g}x forward, K/V in {a.compute_bytes} B, dK/dV in "
          f"{a.kv_grad_bytes} B, linear layers at {3 + a.remat_forward}x their forward FLOPs")


def device_memory_name(cfg: Config, target: targets.Target) -> str:
  """What the peaks must fit (`step_report.device_memory_bytes`), in words."""
  if cfg.plan.device_memory_gb > 0:
    return "plan.device_memory_gb"
  known = target.memory_bytes()
  return (f"one {target.chip}'s memory ({known / targets.GIB:.2f} GiB)" if known else
          "an H200's 141 GB (the target reports no device memory)")


def planned_strategies(cfg: Config) -> tuple[str, ...]:
  """The strategies mode=plan compiles: `plan.strategies`, else every one that splits a
  sequence and can train the objective; one device's where nothing splits a sequence."""
  if cfg.parallel.seq == 1:
    return (SINGLE_DEVICE,)
  every = strategy_names_for(cfg.objective.name, splits_sequences=True)
  asked = cfg.plan.strategy_names
  if unknown := [name for name in asked if name not in every]:
    raise ConfigError(f"plan.strategies={cfg.plan.strategies!r}: {', '.join(unknown)} cannot "
                      f"split a {cfg.objective.name} sequence here; choose among "
                      f"{', '.join(every)}")
  return asked or every


def plan_report(cfg: Config, progress=lambda _: None) -> str:
  """mode=plan: `cfg`'s step compiled under every strategy, side by side, and the pick."""
  p = cfg.parallel
  target = targets.resolve(cfg.plan.target, p.data * p.fsdp * p.seq)
  mesh = make_mesh(cfg, target.devices)  # too few devices is the config's error
  device = step_report.device_memory_bytes(cfg.plan.device_memory_gb, target)
  strategies = planned_strategies(cfg)
  hw, a = mesh_hardware(p.data * p.fsdp * p.seq), assumptions(cfg)
  rows, fallbacks = [], []
  for name, impl, r, tried in compile_each(cfg, strategies, mesh, target, progress):
    fallbacks += [f"{name}: attention {impl}, since {other} did not compile ({why})"
                  for other, why in tried]
    if isinstance(r, str):
      rows.append({"strategy": name, "attention": impl, "projected ms/step": "", "error": r})
      continue
    step = projected_step(override(cfg, [f"parallel.strategy={name}"]), hw, a)
    rows.append({"strategy": name, "attention": impl,
                 "projected ms/step": f"{step['total_s'] * 1e3:.3g}", **step, **r.row()})
  m = cfg.model
  time_caveat = f" (no model of a {target.chip}'s time)" if target.platform == "tpu" else ""
  return "\n".join([
      f"Compiled train step per device ({target.describe()}; "
      f"mesh data={p.data} fsdp={p.fsdp} seq={p.seq}; L={cfg.data.seq_len}, "
      f"B={cfg.objective.block_size}, {cfg.train.batch_size} sequences/step, "
      f"{step_report.describe_objective(cfg)}; {m.n_layers} layers, d_model {m.d_model}, "
      f"remat {m.remat}, {m.compute_dtype} compute). {step_report.peak_note(rows)}; fits = "
      f"{target.compiler}'s device figure against {device_memory_name(cfg, target)}; attention "
      "= K/V, dK/dV and row metadata each device sends per step (from the layout plan); "
      "check = compiled attention collectives / the plan's.", "",
      *([f"One seq rank: every strategy is `{SINGLE_DEVICE}` (nothing splits a sequence), "
         "compiled once.", ""] if p.seq == 1 else []),
      f"Projected = the cost model's step time (analysis/cost_model) on {describe(hw, a)}; "
      f"{sequences(cfg)} sequences per device as one batch. It models H200s only: the memory "
      f"is {target.compiler}'s, the time an H200's{time_caveat}.", "",
      *draft_transport_lines(cfg, strategies),
      *step_report.table(rows, device, keys=("strategy", "attention", "projected ms/step")),
      *fallbacks, "",
      *verdict(rows, device, f"on {hw.name}, default assumptions{time_caveat}",
               target.compiler),
      *(breakdown_lines(cfg, rows, device, mesh) if cfg.plan.breakdown else [])])


def attention_impls(cfg: Config, target: targets.Target) -> tuple[str, ...]:
  """The attention implementations a strategy's step compiles with, in order of preference
  (`plan.attention`): auto puts Splash, the TPU's kernel, first on a TPU target."""
  if cfg.plan.attention != "auto":
    return (cfg.plan.attention,)
  own = cfg.model.attention_impl
  return ("splash", own) if target.platform == "tpu" and own != "splash" else (own,)


def compile_each(cfg: Config, strategies, mesh, target: targets.Target, progress):
  """[(strategy, attention impl, StepReport or why not, [(impl, why not) tried before])]:
  each strategy compiled with the first of `attention_impls` that compiles."""
  impls = attention_impls(cfg, target)
  done, tried = {}, {name: [] for name in strategies}
  for i, impl in enumerate(impls):
    pending = [name for name in strategies if name not in done]
    for name, r in step_report.compare_strategies(
        override(cfg, [f"model.attention_impl={impl}"]), pending, mesh, progress):
      if isinstance(r, str) and i < len(impls) - 1:
        tried[name].append((impl, r))
      else:
        done[name] = (impl, r)
  return [(name, *done[name], tried[name]) for name in strategies if name in done]


def draft_transport_lines(cfg: Config, strategies) -> list[str]:
  """For a drafter, each strategy's draft transport under `parallel.draft_transport` and what
  our rule (auto) and the seed's (seed) pick, with the bytes behind them
  (`step_report.draft_transport_line`), then a blank line; none where no strategy moves only
  the context."""
  lines = []
  for name in strategies:
    try:
      lines.append(step_report.draft_transport_line(
          override(cfg, [f"parallel.strategy={name}"])))
    except ConfigError:  # e.g. draft_transport=query under a strategy that moves the drafts
      continue
  lines = [line for line in lines if line]
  return ["Draft transports:", *lines, ""] if lines else []


def breakdown_lines(cfg: Config, rows: list[dict], device_bytes: float, mesh) -> list[str]:
  """plan.breakdown: the buffers live at the peak of the chosen strategy's step (of the one
  with the least device memory where none fits), by category: what to turn on next."""
  compiled = [r for r in rows if not r.get("error")]
  ranked = fastest_that_fit(rows, device_bytes) or sorted(compiled, key=fit_of)
  if not ranked:
    return []
  name, impl = ranked[0]["strategy"], ranked[0].get("attention", cfg.model.attention_impl)
  _, breakdown = buffers.step_breakdown(
      override(cfg, [f"parallel.strategy={name}", f"model.attention_impl={impl}"]), mesh)
  return ["", f"Breakdown of {name}'s step (compiled again with XLA's buffer-assignment dump):",
          "", *breakdown.lines()]
