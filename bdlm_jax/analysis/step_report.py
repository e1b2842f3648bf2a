"""What one device must hold and send for the real train step, read by compiling it only.

`step_report(cfg, mesh)` compiles `make_train_step(cfg, mesh)` from abstract inputs
(`abstract_state`, `abstract_batch`, an abstract key): nothing is allocated, so an 8B model at
512K tokens compiles on simulated CPU devices (set JAX_NUM_CPU_DEVICES before importing jax),
or, with a mesh on a target's devices (`targets`: a TPU topology's, mock GPU hosts), with
that target's compiler. XLA:CPU is not the GPU compiler: treat its memory as the structure to
optimise (docs/memory.md). Peak memory is the compiler's own `peak_memory_in_bytes` where it
reports one (XLA:TPU, XLA:GPU), else the bound of every buffer live at once (XLA:CPU). Beside
them, the device's own figures from XLA's buffer assignment (`buffer_assignment`, every
compile dumps it): the bytes it allocates in device memory, which is what a fit is judged by
(`fit_bytes`), and those live at its peak. The compiler's peak counts host-resident buffers
where a step offloads; these do not.

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
  query      a drafter's draft queries rotating instead (query_ring.py): P-1 hops of Q +
             metadata and their f32 partial (out, lse) forward; of Q, O, dO + metadata, f32
             LSE and dLSE, and the dQ partial (in parallel.kv_grad_dtype) backward

Under remat `offload_input` the backward re-runs each layer's forward: a ring's and an
exchange's sends run again, but the re-run's all-gather is the backward's own re-gather
(XLA:CPU merges the two), so an all-gather layer moves what it moves under `full`
(`rerun_sends`, which says where XLA:TPU differs).

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
backward's first K/V hop equal to the forward's; or a rotating query's first metadata hop,
which it always does); above 1, that something moves twice (a
rematerialised ring, say).
"""

import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp

from bdlm_jax.batch import abstract_batch
from bdlm_jax.config import Config, ModelConfig, updated
from bdlm_jax.configure import override
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.drafter import drafter_model, target_depth
from bdlm_jax.models.pattern import attention_shape, gdn_shape, layer_types
from bdlm_jax.models.transformer import reruns_attention, stream_reruns
from bdlm_jax.objectives import get_objective
from bdlm_jax.analysis import buffer_assignment, hlo_stats, targets
from bdlm_jax.parallel import query_ring, recurrence
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.prune import pruned_rows
from bdlm_jax.parallel.registry import get_strategy, plan_for, strategy_names_for
from bdlm_jax.parallel.recurrence import RECURRENCE_SCOPE
from bdlm_jax.parallel.strategies import (ATTENTION_SCOPE, draft_transport, exchange_for,
                                         window_transport)
from bdlm_jax.train import abstract_state, make_train_step

GB = 1e9
# int32 stream, block, segment and position travel with each K/V row (`mask.as_keys`), and
# as many with a rotating query (its window start for its position)
META_ROW_BYTES = query_ring.META_ROW_BYTES


def attention_traffic(plan: LayoutPlan, kv_row_bytes: float, grad_row_bytes: float,
                      meta_row_bytes: float, n_layers: int, window: int | None = None,
                      last_grad_row_bytes: float | None = None,
                      first_passes: int = 0, reruns: int = 0,
                      pruned_rows: int = 0) -> dict[str, float]:
  """Operand bytes per device and step (hlo_stats convention), by kind, that the plan's
  transport issues on `n_layers` global layers, or local ones of window W. `*_row_bytes`:
  K and V (their gradients, their metadata) of one travelling row, summed over the
  sequences a device holds; `last_grad_row_bytes`, the ring's last dK/dV hop where a
  compiler narrows it (default `grad_row_bytes`); `first_passes`, forward passes the step
  runs beyond the differentiated one and its backward (the objective's no-gradient
  `first_passes`); `reruns`, the backward's re-runs of each layer's forward (remat
  `offload_input`), which send again only where `rerun_sends` says so; `pruned_rows`, a
  drafter's context rows each rank drops before they could travel (parallel/prune.py)."""
  out = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0.0)
  p = plan.num_ranks
  transport = layer_transport(plan, window)
  if p == 1 or transport == "local":
    return out
  first_passes += reruns * rerun_sends(transport)
  if transport == "exchange":
    # The received rows forward; their dK/dV back by the reverse permutes, in K/V's dtype.
    rows = exchange_for(plan, window).rows_sent()
    out["collective-permute"] = n_layers * rows * (
        2 * kv_row_bytes + meta_row_bytes + first_passes * (kv_row_bytes + meta_row_bytes))
    return out
  travel = plan.rows_per_rank - plan.n_stay - pruned_rows
  kv, grads = travel * (kv_row_bytes + meta_row_bytes), travel * grad_row_bytes
  if transport == "ring":
    last = grads if last_grad_row_bytes is None else travel * last_grad_row_bytes
    out["collective-permute"] = n_layers * ((2 + first_passes) * (p - 1) * kv
                                            + (p - 1) * grads + last)
  else:
    out["all-gather"] = n_layers * (2 + first_passes) * kv
    out["reduce-scatter"] = n_layers * p * grads
  return out


def layer_transport(plan: LayoutPlan, window: int | None = None) -> str:
  """How a global layer (`window` None), or a local one of window W, moves K/V under `plan`."""
  return (get_strategy(plan.strategy).transport if window is None
          else window_transport(plan, window))


def rerun_sends(transport: str) -> bool:
  """Whether the backward's re-run of a layer's forward (remat `offload_input`) sends its
  K/V again: a ring's hops and a windowed exchange's permutes run again, but an all-gather's
  gather is the very one the backward issues anyway (allgather.py re-gathers there), and
  XLA:CPU merges the two identical collectives: its compiled step gathers twice a layer under
  `offload_input` as under `full` (tests/analysis/test_step_report.py). XLA:TPU (libtpu
  0.0.42.1) does not: it compiles one of the two as an all-reduce of the gathered shape, a
  third gather a layer, which this count leaves out (its attention check reads 1.38 there)."""
  return transport != "allgather"


def _collective_itemsize(dtype, platform: str) -> int:
  """Bytes per element a collective of `dtype` moves on `platform` (XLA:CPU widens bf16)."""
  dtype = jnp.dtype(dtype)
  return 4 if dtype == jnp.bfloat16 and platform == "cpu" else dtype.itemsize


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
  if get_strategy(plan.strategy).transport == "ring":
    out["collective-permute"] = (p - 1) * kv
  else:
    out["all-gather"] = kv
  return out


def query_rotation_traffic(plan: LayoutPlan, drafter: ModelConfig, sequences: int, itemsize,
                           grad_dtype) -> dict[str, float]:
  """What a drafter's layers issue where its draft queries rotate (parallel/query_ring.py):
  per layer, P-1 ring hops of each rank's draft rows' `query_hop_bytes` (its forward again
  under remat `offload_input`), all collective-permutes; the context K/V never move."""
  out = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0.0)
  q_row = sequences * drafter.n_heads * drafter.head_dim
  hop = query_ring.query_hop_bytes(
      plan.n_noisy * q_row, plan.n_noisy * sequences * drafter.n_heads,
      itemsize(drafter.compute_dtype), itemsize(grad_dtype),
      plan.n_noisy * sequences * META_ROW_BYTES,
      forwards=1 + reruns_attention(drafter.remat))
  out["collective-permute"] = drafter.n_layers * (plan.num_ranks - 1) * hop
  return out


def config_attention_traffic(cfg: Config, itemsize=lambda dtype: jnp.dtype(dtype).itemsize,
                             narrow_last_hop: bool = False):
  """`attention_traffic` of `cfg` (K/V in compute_dtype, dK/dV in kv_grad_dtype); for a
  drafter objective, its drafter's layers plus its frozen target's `context_traffic` over the
  layers it runs (`target_depth`: none with precomputed features). `narrow_last_hop`: the
  ring's last dK/dV hop travels in the compute dtype, as XLA:TPU compiles it (the hop's
  only use is the K/V cotangent, so the convert moves ahead of the permute)."""
  m, p = cfg.model, cfg.parallel
  objective = get_objective(cfg.objective.name)
  sequences = cfg.train.batch_size // (p.data * p.fsdp) * objective.COPIES  # per device

  def row_bytes(model: ModelConfig, kind: str = "global"):
    """K/V, dK/dV and metadata of one row of a `kind` layer, all sequences."""
    shape = attention_shape(model, kind)
    kv_elems = sequences * 2 * shape.n_kv_heads * shape.head_dim
    return (kv_elems * itemsize(model.compute_dtype), kv_elems * itemsize(p.kv_grad_dtype),
            sequences * META_ROW_BYTES)

  def last_hop(model: ModelConfig, kind: str = "global"):
    return dict(last_grad_row_bytes=row_bytes(model, kind)[0] if narrow_last_hop else None)

  plan = plan_for(cfg)
  if objective.DRAFTER:
    kv, _, meta = row_bytes(m)
    drafter = drafter_model(cfg)
    if draft_transport(cfg, plan) == "query":
      totals = [query_rotation_traffic(plan, drafter, sequences, itemsize, p.kv_grad_dtype)]
    else:
      totals = [attention_traffic(plan, *row_bytes(drafter), drafter.n_layers,
                                  reruns=reruns_attention(drafter.remat),
                                  pruned_rows=pruned_rows(cfg, plan), **last_hop(drafter))]
    totals.append(context_traffic(plan, kv, meta, target_depth(cfg)))
  else:
    kinds = layer_types(m)
    by_kind = [("global", None), ("local", m.sliding_window)]
    totals = [attention_traffic(plan, *row_bytes(m, kind), kinds.count(kind), window,
                                first_passes=objective.first_passes(cfg),
                                reruns=reruns_attention(m.remat), **last_hop(m, kind))
              for kind, window in by_kind if kinds.count(kind)]
  return {kind: sum(t[kind] for t in totals) for kind in hlo_stats.COLLECTIVE_KINDS}


def draft_transport_choices(cfg: Config, plan: LayoutPlan | None = None) -> dict:
  """Both rules' draft transport under `cfg`'s strategy and the bytes behind them, per
  sequence a rank holds, for one hop of one drafter layer (`query_ring.transport_bytes`):
  {"auto": ours' pick, "seed": the seed's pick, "compiled": `parallel.draft_transport`'s,
  "bytes": {"query": , "kv": } as sent (ours), "seed_bytes": the same as the seed counts
  them, "seed_peaks": its memory test's (`query_ring.seed_peaks`)}. Only where a drafter's
  strategy moves only the context (else {}: nothing to choose)."""
  plan = plan_for(cfg) if plan is None else plan
  if not get_objective(cfg.objective.name).DRAFTER or plan.travel != "clean":
    return {}
  rule = lambda name: draft_transport(updated(cfg, parallel=dict(draft_transport=name)), plan)
  return dict(auto=rule("auto"), seed=rule("seed"), compiled=draft_transport(cfg, plan),
              bytes=query_ring.transport_bytes(cfg, plan),
              seed_bytes=query_ring.transport_bytes(cfg, plan, "seed"),
              seed_peaks=query_ring.seed_peaks(cfg, plan))


def draft_transport_line(cfg: Config, plan: LayoutPlan | None = None) -> str:
  """`draft_transport_choices` in one line ("" where there is nothing to choose)."""
  c = draft_transport_choices(cfg, plan)
  if not c:
    return ""
  pair = lambda d: f"query {d['query'] / 1e6:,.1f} / kv {d['kv'] / 1e6:,.1f} MB"
  return (f"{cfg.parallel.strategy}: draft transport {c['compiled']} (parallel.draft_transport="
          f"{cfg.parallel.draft_transport}; auto picks {c['auto']}, seed {c['seed']}); a hop "
          f"of a drafter layer, per sequence: {pair(c['bytes'])} sent (kept context rows); the "
          f"seed counts {pair(c['seed_bytes'])} (unpruned context), peaks "
          f"{pair(c['seed_peaks'])}")


def recurrence_traffic(cfg: Config, itemsize=lambda dtype: jnp.dtype(dtype).itemsize,
                       reruns: int = 0) -> dict[str, float]:
  """Operand bytes per device and step (hlo_stats convention), by kind, of the Gated DeltaNet
  layers' streams (parallel/recurrence.py), forward and backward, for every sequence a device
  holds: the all-gather of segment tails (reduce-scatter back), the chain's one-pair permutes
  of a state [Hv, K, V] f32 (each compiles to one collective every rank runs, though only two
  ranks exchange: this counts what the compiled program counts), and the fetched copies'
  rows (pre-conv rows, g, beta) and entry states; beside the tails and the copies' rows, their
  document ids (int32, forward passes only: no gradient). `reruns`: forward re-runs in the
  backward."""
  out = dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0.0)
  m = cfg.model
  n_layers = layer_types(m).count("gdn")
  plan = plan_for(cfg)
  if not n_layers or plan.num_ranks == 1:
    return out
  program = recurrence.stream_program(plan, m.gdn_conv - 1)
  sequences = (cfg.train.batch_size // (cfg.parallel.data * cfg.parallel.fsdp)
               * get_objective(cfg.objective.name).COPIES)
  hk, hv, dk, dv = gdn_shape(m)
  row = (2 * hk * dk + hv * dv) * itemsize(m.compute_dtype)  # one pre-conv row
  state = hv * dk * dv * itemsize(jnp.float32)
  passes = 1 + reruns
  doc_id = itemsize(jnp.int32)
  if program.shares_tails:
    tails = program.own * program.halo * row
    out["all-gather"] += passes * (tails + program.own * program.halo * doc_id)
    out["reduce-scatter"] += plan.num_ranks * tails
  hops = sum(q != r for r, _, q, _ in program.chain)
  fetches = len(program.fetch_permutes())
  copy = program.seg_len * (row + 2 * hv * itemsize(jnp.float32)) + state
  out["collective-permute"] += ((passes + 1) * (hops * state + fetches * copy)
                                + passes * fetches * program.seg_len * doc_id)
  out = {k: n_layers * sequences * v for k, v in out.items()}
  # The conv kernel enters the shard_map whole: its gradient is summed over `seq` there.
  out["all-reduce"] += n_layers * (2 * hk * dk + hv * dv) * m.gdn_conv * itemsize(m.param_dtype)
  return out


def expected_attention_operand_bytes(cfg: Config, platform: str | None = None) -> float:
  """`config_attention_traffic` in the element sizes collectives compile to on `platform`
  (default: this process's backend): what the compiled attention collectives should add up
  to (`StepReport.attention_check`)."""
  platform = platform or jax.default_backend()
  itemsize = lambda dtype: _collective_itemsize(dtype, platform)
  return sum(config_attention_traffic(cfg, itemsize, narrow_last_hop=platform == "tpu").values())


def expected_recurrence_operand_bytes(cfg: Config, platform: str | None = None) -> float:
  """`recurrence_traffic` likewise, its forward re-run under remat included: what the
  compiled Gated DeltaNet streams should add up to (`StepReport.recurrence_check`)."""
  platform = platform or jax.default_backend()
  return sum(recurrence_traffic(cfg, lambda dtype: _collective_itemsize(dtype, platform),
                                reruns=stream_reruns(cfg.model.remat)).values())


@dataclasses.dataclass(frozen=True)
class StepReport:
  """Per-device figures of one compiled train step; bytes unless named otherwise."""
  argument_bytes: int  # state shards, batch rows, key
  temp_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments (the new state)
  # the compiler's own peak_memory_in_bytes (XLA:TPU, XLA:GPU); None on XLA:CPU, whose
  # figure leaves out the temp buffers
  compiler_peak_bytes: int | None
  host_bytes: int  # host memory (offloaded buffers), from memory_analysis's host_* sizes
  compile_s: float  # trace + lower + compile
  collective_bytes: dict  # {kind: operand bytes}, the whole compiled step
  attention_collective_bytes: dict  # the part issued inside the attention shard_map
  attention_bytes: float  # sent for attention, from the plan (wire bytes, config dtypes)
  expected_attention_operand_bytes: float  # the plan's, in the compiled element sizes
  # the Gated DeltaNet layers' streams (parallel/recurrence.py): compiled, and the program's
  recurrence_collective_bytes: dict = dataclasses.field(
      default_factory=lambda: dict.fromkeys(hlo_stats.COLLECTIVE_KINDS, 0))
  expected_recurrence_operand_bytes: float = 0.0
  # XLA's buffer assignment (`buffer_assignment.DeviceMemory`): every allocation in the
  # device's own memory, and the bytes of it live at the step's peak; None where not read
  device_allocated_bytes: int | None = None
  device_live_bytes: int | None = None
  # the matmuls' FLOPs a step (`hlo_stats.dot_flops`), and those of one run of the loops
  # whose trip count is data-dependent (not in the first figure)
  dot_flops: float | None = None
  dot_flops_uncounted: float | None = None

  @property
  def bound_bytes(self) -> int:
    """arguments + temp + output - alias: every buffer live at once, an upper bound."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

  @property
  def peak_bytes(self) -> int:
    """Device memory at the step's peak: the compiler's own peak where it reports one, else
    `bound_bytes`. XLA:TPU's peak counts host-resident buffers too (a step's peak grows with
    the bytes it offloads while its device buffers do not: docs/memory.md), so with any the
    device's figure is the smaller of the two."""
    if self.compiler_peak_bytes is None:
      return self.bound_bytes
    if self.host_bytes:
      return min(self.compiler_peak_bytes, self.bound_bytes)
    return self.compiler_peak_bytes

  @property
  def weight_collective_bytes(self) -> dict:
    return {k: v - self.attention_collective_bytes[k] - self.recurrence_collective_bytes[k]
            for k, v in self.collective_bytes.items()}

  @property
  def attention_check(self) -> float | None:
    """Compiled attention operand bytes / the plan's; None where nothing should move."""
    compiled = sum(self.attention_collective_bytes.values())
    return compiled / self.expected_attention_operand_bytes \
        if self.expected_attention_operand_bytes else None

  @property
  def recurrence_check(self) -> float | None:
    """Compiled recurrence operand bytes / the program's; None where nothing should move."""
    compiled = sum(self.recurrence_collective_bytes.values())
    return compiled / self.expected_recurrence_operand_bytes \
        if self.expected_recurrence_operand_bytes else None

  @property
  def fit_bytes(self) -> int:
    """What the device must hold to run the step: its allocation in device memory (host
    buffers apart) where the buffer assignment was read, else `peak_bytes`."""
    return self.peak_bytes if self.device_allocated_bytes is None \
        else self.device_allocated_bytes

  def fits(self, device_bytes: float) -> bool:
    return self.fit_bytes <= device_bytes

  def row(self) -> dict:
    """Flat figures for a CSV row or a table."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if not isinstance(getattr(self, f.name), dict)}
    out.update(peak_bytes=self.peak_bytes, bound_bytes=self.bound_bytes, fit_bytes=self.fit_bytes,
               attention_check=self.attention_check, recurrence_check=self.recurrence_check,
               recurrence_bytes=sum(self.recurrence_collective_bytes.values()),
               collective_total_bytes=sum(self.collective_bytes.values()),
               attention_collective_total_bytes=sum(self.attention_collective_bytes.values()),
               weight_collective_total_bytes=sum(self.weight_collective_bytes.values()))
    for kind in hlo_stats.COLLECTIVE_KINDS:
      key = kind.replace("-", "_")
      out[f"attention_{key}_bytes"] = self.attention_collective_bytes[kind]
      out[f"weight_{key}_bytes"] = self.weight_collective_bytes[kind]
    return out


def lower_train_step(cfg: Config, mesh):
  """The real train step lowered from abstract inputs (nothing allocated)."""
  key = jax.eval_shape(lambda: jax.random.key(0))
  return make_train_step(cfg, mesh).lower(abstract_state(cfg, mesh), abstract_batch(cfg, mesh),
                                          key)


def compile_train_step(cfg: Config, mesh, compiler_options: dict | None = None):
  """(compiled, seconds): the real train step compiled from abstract inputs (with XLA's
  `compiler_options`, e.g. `buffer_assignment.dump_options`)."""
  start = time.perf_counter()
  compiled = lower_train_step(cfg, mesh).compile(compiler_options=compiler_options)
  return compiled, time.perf_counter() - start


def compiled_memory(compiled, platform: str) -> dict:
  """Per-device memory of a compiled step, as `StepReport` holds it: on XLA:CPU no compiler
  peak (its peak_memory_in_bytes leaves out the temp buffers)."""
  memory = hlo_stats.memory_stats(compiled)
  host = sum(memory.get(f"host_{k}_size_in_bytes", 0) for k in ("argument", "temp", "output"))
  return dict(
      argument_bytes=memory["argument_size_in_bytes"], temp_bytes=memory["temp_size_in_bytes"],
      output_bytes=memory["output_size_in_bytes"], alias_bytes=memory["alias_size_in_bytes"],
      compiler_peak_bytes=None if platform == "cpu" else memory.get("peak_memory_in_bytes"),
      host_bytes=host - memory.get("host_alias_size_in_bytes", 0))


def step_report(cfg: Config, mesh=None, dump_to: str | None = None) -> StepReport:
  """Compiles `cfg`'s train step on `mesh` (default `make_mesh(cfg)`; its devices' platform
  is the compiler, `targets`) and reads its costs, the device's memory from XLA's buffer
  assignment, dumped to `dump_to` (default a temporary folder; buffers.py reads it further)."""
  mesh = make_mesh(cfg) if mesh is None else mesh
  platform = mesh.devices.flat[0].platform
  targets.check(cfg, platform)
  with tempfile.TemporaryDirectory(prefix="bdlm_step_") as scratch:
    folder = dump_to or scratch
    compiled, seconds = compile_train_step(cfg, mesh, buffer_assignment.dump_options(folder))
    device = buffer_assignment.device_memory(folder)
  return StepReport(
      **compiled_memory(compiled, platform),
      compile_s=seconds, collective_bytes=hlo_stats.collective_bytes(compiled),
      attention_collective_bytes=hlo_stats.collective_bytes(compiled, ATTENTION_SCOPE),
      attention_bytes=hlo_stats.wire_bytes(config_attention_traffic(cfg), cfg.parallel.seq),
      expected_attention_operand_bytes=expected_attention_operand_bytes(cfg, platform),
      recurrence_collective_bytes=hlo_stats.collective_bytes(compiled, RECURRENCE_SCOPE),
      expected_recurrence_operand_bytes=expected_recurrence_operand_bytes(cfg, platform),
      device_allocated_bytes=device.allocated_bytes, device_live_bytes=device.live_bytes,
      **dict(zip(("dot_flops", "dot_flops_uncounted"), hlo_stats.dot_flops(compiled))))


def compare_strategies(cfg: Config, strategies=None, mesh=None,
                       progress=lambda _: None) -> list:
  """[(strategy, StepReport or the reason it cannot run)] for `cfg` under each strategy
  (default: every registered one that can train its objective)."""
  out = []
  for strategy in strategy_names_for(cfg.objective.name) if strategies is None else strategies:
    try:
      report = step_report(override(cfg, [f"parallel.strategy={strategy}"]), mesh)
    except ConfigError as e:
      report = str(e)
    except Exception as e:  # noqa: BLE001 (a strategy that does not compile is a finding)
      report = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    jax.clear_caches()  # one compiled step at a time in host memory
    progress(f"{strategy}: " + (report if isinstance(report, str) else
                               f"{report.fit_bytes / GB:.2f} GB on the device, peak "
                               f"{report.peak_bytes / GB:.2f} GB, compiled in "
                               f"{report.compile_s:.1f} s"))
    out.append((strategy, report))
  return out


def device_memory_bytes(gb: float = 0.0, target: targets.Target | None = None) -> float:
  """`gb` if set, else the target's device memory where it knows it (a TPU chip's HBM, what
  a GPU reports), else an H200's 141 GB."""
  if gb > 0:
    return gb * GB
  return (target.memory_bytes() if target else None) or 141 * GB


def format_gb(nbytes: float) -> str:
  """GB with two decimals; a figure under 0.01 GB in scientific notation."""
  return f"{nbytes / GB:.2f}" if nbytes == 0 or nbytes >= 0.01 * GB else f"{nbytes / GB:.1e}"


def fit_of(row: dict) -> float:
  """A row's `StepReport.fit_bytes`; a row written before it existed fits by its peak."""
  return float(row.get("fit_bytes") or row["peak_bytes"])


def peak_note(rows: list[dict]) -> str:
  """Which figures a table's memory columns hold, for its header."""
  device = ("device = what XLA's buffer assignment allocates in device memory (host buffers "
            "apart), which fits are judged by; live = its bytes live at the step's peak")
  if any(r.get("compiler_peak_bytes") is not None for r in rows if not r.get("error")):
    return ("Peak = the compiler's own peak_memory_in_bytes; bound = arguments + temp + output "
            f"- alias (every buffer live at once, an upper bound); {device}")
  return ("Peak = bound = arguments + temp + output - alias (every buffer live at once; "
          f"XLA:CPU reports no peak of its own); {device}")


def _gb_or_dash(row: dict, key: str) -> str:
  return "—" if row.get(key) in (None, "") else format_gb(float(row[key]))


def table(rows: list[dict], device_bytes: float, keys=("strategy",)) -> list[str]:
  """Markdown lines, one per row: `keys` columns, then the figures (GB per device) or the
  row's `error`. A row written before `bound_bytes` existed holds the bound as its peak."""
  limit = f"fits {device_bytes / GB:g} GB"
  # Gated DeltaNet streams' columns where a row has them: compiled operand bytes, and check
  gdn = any(r.get("expected_recurrence_operand_bytes") for r in rows if not r.get("error"))
  head = ["arguments GB", "temp GB", "peak GB", "bound GB", "device GB", "live GB",
          "compile s", "attention GB/step", "attention check",
          *(["GDN operand GB/step", "GDN check"] if gdn else []), limit]
  lines = ["| " + " | ".join([*keys, *head]) + " |", "|" + "---|" * (len(keys) + len(head))]
  for r in rows:
    cells = [str(r[k]) for k in keys]
    if r.get("error"):
      cells += [f"not run: {r['error']}"] + [""] * (len(head) - 1)
    else:
      check = r["attention_check"]
      cells += [format_gb(r["argument_bytes"]), format_gb(r["temp_bytes"]),
                format_gb(r["peak_bytes"]),
                format_gb(r.get("bound_bytes") or r["peak_bytes"]),
                _gb_or_dash(r, "device_allocated_bytes"), _gb_or_dash(r, "device_live_bytes"),
                f"{r['compile_s']:.1f}", format_gb(r["attention_bytes"]),
                "—" if check is None else f"{check:.2f}"]
      if gdn:
        cells += [format_gb(r["recurrence_bytes"]),
                  "—" if r["recurrence_check"] is None else f"{r['recurrence_check']:.2f}"]
      cells.append("yes" if fit_of(r) <= device_bytes else "**no**")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def choose(rows: list[dict], device_bytes: float) -> dict | None:
  """The row that fits (by `fit_of`) with the least attention traffic (then the least
  device memory), or None."""
  fit = [r for r in rows if not r.get("error") and fit_of(r) <= device_bytes]
  return min(fit, key=lambda r: (r["attention_bytes"], fit_of(r)), default=None)


def describe_objective(cfg: Config) -> str:
  """The objective's name; a drafter's with its anchors and its own layers."""
  o = cfg.objective
  if not get_objective(o.name).DRAFTER:
    return o.name
  d = drafter_model(cfg)
  return (f"{o.name} ({o.max_anchors} anchors; a {d.n_layers}-layer drafter, {d.n_heads} q / "
          f"{d.n_kv_heads} kv heads of {d.head_dim}, over the frozen target)")

