"""What one device must hold and send for the real train step, read by compiling it only.

`step_report(cfg, mesh)` compiles `make_train_step(cfg, mesh)` from abstract inputs
(`abstract_state`, `abstract_batch`, an abstract key): nothing is allocated, so an 8B model at
512K tokens compiles on simulated CPU devices (set JAX_NUM_CPU_DEVICES before importing jax).
XLA:CPU is not the GPU compiler: treat its memory as the structure to optimise (DESIGN.md 9).

Attention traffic is *computed* from the layout plan, not read back, because the compiled
bytes are not those a GPU moves: XLA:CPU widens bf16 collectives to f32 (hlo_stats), and XLA
may hoist the loop-invariant row-metadata hops out of the layer scan. `attention_traffic`
counts what ring.py / allgather.py issue per layer, for every sequence a device holds:

  ring       collective-permute: P-1 hops of K/V + metadata forward, P-1 backward, and P hops
             of the dK/dV accumulators (in parallel.kv_grad_dtype)
  allgather  all-gather of the K/V + metadata shard forward and again backward;
             reduce-scatter of the P gathered dK/dV shards (in parallel.kv_grad_dtype)
  local      nothing (`bp`, one rank)
  exchange   a local layer's windowed exchange (window.py): its rows + metadata forward,
             their dK/dV back by the reverse permutes (in the compute dtype)

A drafter objective (dflash) adds its frozen target's layers (`context_traffic`): forward
only, over every row of each rank's clean slot (the context), with the target's K/V widths;
its drafter's layers are counted as above, with the drafter's.

For one layer this equals the compiled attention probe exactly (tests/parallel/
test_step_report.py). The compiled step's own split is reported too: collectives issued
inside the attention `shard_map` (its name scope, `strategies.ATTENTION_SCOPE`) vs the rest, which is weight
traffic (parameter all-gathers, gradient reductions); `attention_check` compares the former
with the plan's figure in the compiled program's element sizes. 1.00 means the core moves
exactly what its transport should; a little below, that XLA hoisted the layer-invariant
metadata hops out of the layer scan (or, with P = 2 and one inlined layer, found the
backward's first K/V hop equal to the forward's); above 1, that something moves twice (a
rematerialised ring, say).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from bdlm_jax.batch import abstract_batch
from bdlm_jax.config import (STRATEGIES, Config, ConfigError, ModelConfig, drafter_model,
                             layer_types, override, target_depth)
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel import hlo_stats
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.strategies import (ATTENTION_SCOPE, TRANSPORTS, exchange_for,
                                         plan_for, window_transport)
from bdlm_jax.train import abstract_state, make_train_step

GB = 1e9
# int32 stream, block, segment and position travel with each row (`mask.as_keys`)
META_ROW_BYTES = (len(RowMeta._fields) - 1) * 4


def attention_traffic(plan: LayoutPlan, kv_row_bytes: float, grad_row_bytes: float,
                      meta_row_bytes: float, n_layers: int,
                      window: int | None = None) -> dict[str, float]:
  """Operand bytes per device and step (hlo_stats convention), by kind, that the plan's
  transport issues on `n_layers` global layers, or local ones of window W. `*_row_bytes`:
  K and V (their gradients, their metadata) of one travelling row, summed over the
  sequences a device holds."""
  out = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0.0)
  p = plan.num_ranks
  transport = TRANSPORTS[plan.strategy] if window is None else window_transport(plan, window)
  if p == 1 or transport == "local":
    return out
  if transport == "exchange":
    # The received rows forward; their dK/dV back by the reverse permutes, in K/V's dtype.
    rows = exchange_for(plan, window).rows_sent()
    out["collective-permute"] = n_layers * rows * (2 * kv_row_bytes + meta_row_bytes)
    return out
  travel = plan.rows_per_rank - plan.n_stay
  kv, grads = travel * (kv_row_bytes + meta_row_bytes), travel * grad_row_bytes
  if transport == "ring":
    out["collective-permute"] = n_layers * (2 * (p - 1) * kv + p * grads)
  else:
    out["all-gather"] = n_layers * 2 * kv
    out["reduce-scatter"] = n_layers * p * grads
  return out


def _collective_itemsize(dtype) -> int:
  """Bytes per element a collective of `dtype` moves on this backend (XLA:CPU widens bf16)."""
  dtype = jnp.dtype(dtype)
  return 4 if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype.itemsize


def context_traffic(plan: LayoutPlan, kv_row_bytes: float, meta_row_bytes: float,
                    n_layers: int) -> dict[str, float]:
  """What a drafter's frozen target issues on `n_layers` layers (`make_attend(rows="clean")`
  with no gradient): every row of each rank's clean slot travels forward only, P-1 ring hops
  or one all-gather of K/V + metadata; nothing when the plan moves nothing (`bp` replicates
  the context, one rank)."""
  out = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0.0)
  p = plan.num_ranks
  if p == 1 or plan.travel == "none":
    return out
  kv = n_layers * (plan.rows_per_rank - plan.n_noisy) * (kv_row_bytes + meta_row_bytes)
  if TRANSPORTS[plan.strategy] == "ring":
    out["collective-permute"] = (p - 1) * kv
  else:
    out["all-gather"] = kv
  return out


def config_attention_traffic(cfg: Config, itemsize=lambda dtype: jnp.dtype(dtype).itemsize):
  """`attention_traffic` of `cfg` (K/V in compute_dtype, dK/dV in kv_grad_dtype); for a
  drafter objective, its drafter's layers plus its frozen target's `context_traffic` over the
  layers it runs (`target_depth`: none with precomputed features)."""
  m, p = cfg.model, cfg.parallel
  objective = get_objective(cfg.objective.name)
  sequences = cfg.train.batch_size // (p.data * p.fsdp) * objective.COPIES  # per device

  def row_bytes(model: ModelConfig):  # K/V, dK/dV and metadata of one row, all sequences
    kv_elems = sequences * 2 * model.n_kv_heads * model.head_dim
    return (kv_elems * itemsize(model.compute_dtype), kv_elems * itemsize(p.kv_grad_dtype),
            sequences * META_ROW_BYTES)

  plan = plan_for(cfg)
  if objective.DRAFTER:
    kv, _, meta = row_bytes(m)
    drafter = drafter_model(cfg)
    totals = [attention_traffic(plan, *row_bytes(drafter), drafter.n_layers)]
    totals.append(context_traffic(plan, kv, meta, target_depth(cfg)))
  else:
    kinds = layer_types(m)
    by_window = [(None, kinds.count("global")), (m.sliding_window, kinds.count("local"))]
    totals = [attention_traffic(plan, *row_bytes(m), n, window) for window, n in by_window
              if n]
  return {kind: sum(t[kind] for t in totals) for kind in hlo_stats.COLLECTIVE_KINDS}


def expected_attention_operand_bytes(cfg: Config) -> float:
  """`config_attention_traffic` in the element sizes this backend's collectives compile to:
  what the compiled attention collectives should add up to (`StepReport.attention_check`)."""
  return sum(config_attention_traffic(cfg, _collective_itemsize).values())


@dataclasses.dataclass(frozen=True)
class StepReport:
  """Per-device figures of one compiled train step; bytes unless named otherwise."""
  argument_bytes: int  # state shards, batch rows, key
  temp_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments (the new state)
  compile_s: float  # trace + lower + compile
  collective_bytes: dict  # {kind: operand bytes}, the whole compiled step
  attention_collective_bytes: dict  # the part issued inside the attention shard_map
  attention_bytes: float  # sent for attention, from the plan (wire bytes, config dtypes)
  expected_attention_operand_bytes: float  # the plan's, in the compiled element sizes

  @property
  def peak_bytes(self) -> int:
    """arguments + temp + output - alias: every buffer live at once, an upper bound.
    (memory_analysis's own peak_memory_in_bytes leaves out temp buffers on XLA:CPU.)"""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

  @property
  def weight_collective_bytes(self) -> dict:
    return {k: v - self.attention_collective_bytes[k] for k, v in self.collective_bytes.items()}

  @property
  def attention_check(self) -> float | None:
    """Compiled attention operand bytes / the plan's; None where nothing should move."""
    compiled = sum(self.attention_collective_bytes.values())
    return compiled / self.expected_attention_operand_bytes \
        if self.expected_attention_operand_bytes else None

  def fits(self, device_bytes: float) -> bool:
    return self.peak_bytes <= device_bytes

  def row(self) -> dict:
    """Flat figures for a CSV row or a table."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if not isinstance(getattr(self, f.name), dict)}
    out.update(peak_bytes=self.peak_bytes, attention_check=self.attention_check)
    for kind in hlo_stats.COLLECTIVE_KINDS:
      key = kind.replace("-", "_")
      out[f"attention_{key}_bytes"] = self.attention_collective_bytes[kind]
      out[f"weight_{key}_bytes"] = self.weight_collective_bytes[kind]
    return out


def compile_train_step(cfg: Config, mesh):
  """(compiled, seconds): the real train step compiled from abstract inputs."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  start = time.perf_counter()
  lowered = make_train_step(cfg, mesh).lower(abstract_state(cfg, mesh),
                                             abstract_batch(cfg, mesh), key)
  compiled = lowered.compile()
  return compiled, time.perf_counter() - start


def step_report(cfg: Config, mesh=None) -> StepReport:
  """Compiles `cfg`'s train step on `mesh` (default `make_mesh(cfg)`) and reads its costs."""
  mesh = make_mesh(cfg) if mesh is None else mesh
  compiled, seconds = compile_train_step(cfg, mesh)
  memory = hlo_stats.memory_stats(compiled)
  return StepReport(
      argument_bytes=memory["argument_size_in_bytes"], temp_bytes=memory["temp_size_in_bytes"],
      output_bytes=memory["output_size_in_bytes"], alias_bytes=memory["alias_size_in_bytes"],
      compile_s=seconds, collective_bytes=hlo_stats.collective_bytes(compiled),
      attention_collective_bytes=hlo_stats.collective_bytes(compiled, ATTENTION_SCOPE),
      attention_bytes=hlo_stats.wire_bytes(config_attention_traffic(cfg), cfg.parallel.seq),
      expected_attention_operand_bytes=expected_attention_operand_bytes(cfg))


def compare_strategies(cfg: Config, strategies=STRATEGIES, mesh=None,
                       progress=lambda _: None) -> list:
  """[(strategy, StepReport or the reason it cannot run)] for `cfg` under each strategy."""
  out = []
  for strategy in strategies:
    try:
      report = step_report(override(cfg, [f"parallel.strategy={strategy}"]), mesh)
    except ConfigError as e:
      report = str(e)
    except Exception as e:  # noqa: BLE001 (a strategy that does not compile is a finding)
      report = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    jax.clear_caches()  # one compiled step at a time in host memory
    progress(f"{strategy}: " + (report if isinstance(report, str) else
                               f"peak {report.peak_bytes / GB:.2f} GB, compiled in "
                               f"{report.compile_s:.1f} s"))
    out.append((strategy, report))
  return out


def device_memory_bytes(gb: float = 0.0) -> float:
  """`gb` if set, else what the first device reports, else an H200's 141 GB."""
  if gb > 0:
    return gb * GB
  stats = jax.devices()[0].memory_stats() or {}
  return float(stats.get("bytes_limit", 141 * GB))


def _gb(nbytes: float) -> str:
  return f"{nbytes / GB:.2f}" if nbytes == 0 or nbytes >= 0.01 * GB else f"{nbytes / GB:.1e}"


def table(rows: list[dict], device_bytes: float, keys=("strategy",)) -> list[str]:
  """Markdown lines, one per row: `keys` columns, then the figures (GB per device) or the
  row's `error`."""
  limit = f"fits {device_bytes / GB:g} GB"
  head = ["arguments GB", "temp GB", "peak GB", "compile s", "attention GB/step",
          "attention check", limit]
  lines = ["| " + " | ".join([*keys, *head]) + " |", "|" + "---|" * (len(keys) + len(head))]
  for r in rows:
    cells = [str(r[k]) for k in keys]
    if r.get("error"):
      cells += [f"not run: {r['error']}"] + [""] * (len(head) - 1)
    else:
      check = r["attention_check"]
      cells += [_gb(r["argument_bytes"]), _gb(r["temp_bytes"]), _gb(r["peak_bytes"]),
                f"{r['compile_s']:.1f}", _gb(r["attention_bytes"]),
                "—" if check is None else f"{check:.2f}",
                "yes" if r["peak_bytes"] <= device_bytes else "**no**"]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def choose(rows: list[dict], device_bytes: float) -> dict | None:
  """The row that fits with the least attention traffic (then the least peak), or None."""
  fit = [r for r in rows if not r.get("error") and r["peak_bytes"] <= device_bytes]
  return min(fit, key=lambda r: (r["attention_bytes"], r["peak_bytes"]), default=None)


def describe_objective(cfg: Config) -> str:
  """The objective's name; a drafter's with its anchors and its own layers."""
  o = cfg.objective
  if not get_objective(o.name).DRAFTER:
    return o.name
  d = drafter_model(cfg)
  return (f"{o.name} ({o.max_anchors} anchors; a {d.n_layers}-layer drafter, {d.n_heads} q / "
          f"{d.n_kv_heads} kv heads of {d.head_dim}, over the frozen target)")


def plan_report(cfg: Config, progress=lambda _: None) -> str:
  """mode=plan: `cfg`'s step compiled under every strategy, side by side, and the pick."""
  mesh = make_mesh(cfg)  # too few devices is the config's error, not a strategy's
  device = device_memory_bytes(cfg.plan.device_memory_gb)
  strategies = [s for s in STRATEGIES if s != "none" or cfg.parallel.seq == 1]
  rows = [dict(strategy=name, **(r.row() if isinstance(r, StepReport) else dict(error=r)))
          for name, r in compare_strategies(cfg, strategies, mesh, progress)]
  m, p = cfg.model, cfg.parallel
  best = choose(rows, device)
  return "\n".join([
      f"Compiled train step per device ({jax.device_count()} {jax.default_backend()} devices; "
      f"mesh data={p.data} fsdp={p.fsdp} seq={p.seq}; L={cfg.data.seq_len}, "
      f"B={cfg.objective.block_size}, {cfg.train.batch_size} sequences/step, "
      f"{describe_objective(cfg)}; {m.n_layers} layers, d_model {m.d_model}, remat {m.remat}, "
      f"{m.compute_dtype} compute). Peak = arguments + temp + output - alias; attention = "
      "K/V, dK/dV and row metadata each device sends per step (from the layout plan); "
      "check = compiled attention collectives / the plan's.", "",
      *table(rows, device), "",
      f"chosen: {best['strategy']} (fits {device / GB:g} GB with the least attention "
      "traffic)" if best else f"chosen: none (no strategy fits {device / GB:g} GB per device)"])
