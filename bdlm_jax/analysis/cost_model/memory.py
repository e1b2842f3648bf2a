"""Bytes per GPU: assumed from what a step holds, or compiled where scale_probe ran.

Assumed: model states (ZeRO-3 over all GPUs) + what full remat saves per layer (the layer
input, the attention output and its LSE, a local layer's exchanged K/V; under `offload` in
host memory, but for two layers' worth) + the largest transient (one layer's backward, or one
loss chunk of `model.logits_chunk` rows). Compiled: the per-device figure of the real train
step that experiments/scale_probe.py compiled (`load_probe`), used for every block size of
that (model, L, strategy), since B moves memory only through layout padding; of several
compilers, the most realistic (an accelerator compiler's own peak before XLA:CPU's
every-buffer bound), and each figure names its compiler. The assumption reads about half of
every XLA:CPU compile.
"""

import csv
import dataclasses

from bdlm_jax.analysis.cost_model import gdn
from bdlm_jax.analysis.cost_model.setting import MODELS, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.work import (PlanWork, attention_kinds, expert_slots, kv_row,
                                               moe_layers)
from bdlm_jax.analysis.targets import platform_of
from bdlm_jax.config import ModelConfig
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.metrics import param_count
from bdlm_jax.models.transformer import reruns_attention
from bdlm_jax.parallel.strategies import exchange_for, window_transport

# int32 position and row metadata (`RowMeta`) a layer input carries with each row
INPUT_META_BYTES_PER_ROW = (1 + len(RowMeta._fields)) * 4
# The override that compiles an MoE with its ragged dispatch (experiments/scale_probe.py).
RAGGED_DISPATCH = "parallel.moe_dispatch=ragged_all_to_all"


def peak_memory(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions) -> dict:
  """Bytes per rank, assumed: states + saved activations + the largest transient buffer, of
  the layer kind (global, local of window W, Gated DeltaNet: the f32 states its chain
  program keeps) that needs the most."""
  e = a.compute_bytes
  rows = work.plan.rows_per_rank
  kv = kv_row(m)
  q_row = m.n_heads * m.head_dim
  states = param_count(m) * a.state_bytes_per_param / hw.num_gpus
  # Transient while one layer runs its backward: recomputed MLP/projections and their
  # gradients, the f32 dq, and the K/V buffers in flight with their f32 gradients. An MoE's
  # MLP runs on its experts' received rows: they, the rows sent and received back, and the
  # experts' intermediates (`parallel.experts`, ragged_all_to_all dispatch).
  if moe_layers(m):
    pairs, slots = expert_slots(m, rows, hw.num_gpus)
    mlp = slots * 3 * (m.moe_d_ff or m.d_ff) + 2 * (pairs + slots) * m.d_model
  else:
    mlp = rows * 3 * m.d_ff
  linear_tmp = 2 * (mlp + rows * (m.d_model + q_row + kv // 2)) * e + rows * q_row * 4
  if work.transport == "ring":
    kv_tmp = 2 * work.n_travel * kv * (e + a.kv_grad_bytes)  # current + next, kv + dkv
  else:  # every visible key's K/V and f32 dK/dV (the all-gather gathers all ranks' part)
    gathered = work.plan.num_ranks * work.n_travel
    kv_tmp = (work.n_stay + gathered) * kv * (e + 4)
  saved = transient = 0
  for window, n in attention_kinds(m):
    layer_kv = kv_tmp
    if window is not None and window_transport(work.plan, window) == "exchange":
      received = exchange_for(work.plan, window).rows_sent()
      layer_kv = (rows + received) * kv * 2 * e  # [own ; received] K/V and their dK/dV
    saved += n * saved_layer_bytes(m, work, window, a)
    transient = max(transient, linear_tmp + layer_kv)
  if gdn.gdn_layers(m):
    saved += gdn.gdn_layers(m) * layer_input_bytes(m, work, a)
    transient = max(transient, linear_tmp
                    + gdn.chain_layer(m, work.plan).state_bytes)
  chunk = min(m.logits_chunk or work.plan.n_noisy, work.plan.n_noisy)  # loss.chunked_loss
  logits_tmp = 2 * chunk * m.vocab_size * 4
  transient = max(transient, logits_tmp)
  host = 0.0
  if m.remat == "offload_period":  # each scan step's input; a step's layers keep `full`'s
    full = dataclasses.replace(m, remat="full")  # saves on the device while it runs backward
    host = m.n_layers * step_share(m) * layer_input_bytes(m, work, a)
    saved = m.scan_step * max([saved_layer_bytes(full, work, w, a) for w, _ in
                               attention_kinds(m)] + [layer_input_bytes(m, work, a)])
  elif m.remat.startswith("offload"):  # in host memory, but for the layer streaming out or in
    host, saved = saved, 2 * max([saved_layer_bytes(m, work, w, a) for w, _ in
                                  attention_kinds(m)] + [layer_input_bytes(m, work, a)])
  total = states + saved + transient
  return dict(total_bytes=total, states_bytes=states, saved_bytes=saved,
              transient_bytes=transient, host_bytes=host)


def layer_input_bytes(m: ModelConfig, work: PlanWork, a: Assumptions) -> float:
  """Bytes per rank of one layer's input with its row metadata: all that remat
  `offload_input` saves of a layer, and any remat of a Gated DeltaNet layer (its stream is
  recomputed: parallel/recurrence.py)."""
  return work.plan.rows_per_rank * (m.d_model * a.compute_bytes + INPUT_META_BYTES_PER_ROW)


def step_share(m: ModelConfig) -> float:
  """The share of a layer's input that remat keeps: under `offload_period` one scan step's
  input stands for its `scan_step` layers'."""
  return 1 / m.scan_step if m.remat == "offload_period" else 1.0


def saved_layer_bytes(m: ModelConfig, work: PlanWork, window: int | None,
                      a: Assumptions) -> float:
  """Bytes per rank one layer (global: `window` None) saves for its backward under remat
  `full`, or copies to host memory and back under `offload` (`models.transformer.
  remat_policy`): the layer input with its row metadata, the attention core's output and
  LSE, and a local layer's exchanged K/V rows with theirs; q, K/V and any gathered K/V are
  recomputed. Under `offload_input`, the layer input with its row metadata only; under
  `offload_period`, a layer's share of its scan step's input."""
  rows = work.plan.rows_per_rank
  if reruns_attention(m.remat):
    return layer_input_bytes(m, work, a) * step_share(m)
  saved = rows * ((m.d_model + m.n_heads * m.head_dim) * a.compute_bytes
                  + INPUT_META_BYTES_PER_ROW + 4 * m.n_heads)
  if window is not None and window_transport(work.plan, window) == "exchange":
    received = exchange_for(work.plan, window).rows_sent()
    saved += received * (kv_row(m) * a.compute_bytes + a.meta_bytes_per_row)
  return saved


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One compiled per-device figure and where it came from."""
  nbytes: float
  compiler: str  # XLA:TPU, XLA:GPU or XLA:CPU
  figure: str  # "peak": the compiler's own; "bound": every buffer live at once (XLA:CPU)

  @property
  def source(self) -> str:
    """What a verdict names: 'XLA:TPU peak', 'XLA:CPU bound'."""
    return f"{self.compiler} {self.figure}"


def _the_modelled_step(row: dict) -> bool:
  """A probe row of the step this model projects: as configured (no override); of an MoE,
  its ragged dispatch (the GPU's), compiled with its own ops or with stand-ins, not the
  all_gather one XLA:CPU runs."""
  standins, overrides = row.get("standins") == "True", row.get("overrides") or ""
  if not MODELS[row["model"]].moe_experts:
    return not standins and not overrides
  return overrides == RAGGED_DISPATCH or (standins and not overrides)


def load_probe(paths, hw: Hardware) -> dict:
  """{(model, L, B, strategy): Compiled} from scale_probe CSVs (`paths`: one, or several with
  the most realistic compiler first; a setting takes the first figure found): full-depth
  rows of `MODELS` on `hw.num_gpus` devices that compiled, of the modelled step (an MoE's
  ragged dispatch compiled with its own ops before one with stand-ins). A row that did not
  compile (e.g. over a TPU chip's HBM) gives no figure. The CSV does not record the layer
  pattern: gemma3-27b's XLA:CPU rows were compiled with every layer global, and stand as
  that model's memory (a measured figure of the same model, kept in preference to the
  assumption)."""
  out = {}
  for path in [paths] if isinstance(paths, str) else paths:
    with open(path) as f:
      rows = sorted(csv.DictReader(f), key=lambda r: r.get("standins") == "True")
    for r in rows:
      if r["model"] in MODELS and not r["error"] and not r["depth_check"] \
          and _the_modelled_step(r) \
          and int(r["devices"]) == hw.num_gpus and r["remat"] == "full" \
          and int(r["layers"]) == MODELS[r["model"]].n_layers:
        key = (r["model"], int(r["seq_len"]), int(r["block_size"]), r["strategy"])
        platform = platform_of(r.get("target") or "cpu")
        out.setdefault(key, Compiled(float(r["peak_bytes"]), f"XLA:{platform.upper()}",
                                     "peak" if r.get("compiler_peak_bytes") else "bound"))
  return out


def compiled_peak(compiled: dict, model: str, seq_len: int, block_size: int,
                  strategy: str) -> Compiled | None:
  """The compiled figure of this setting, else of the same (model, L, strategy) compiled at
  another block size, else None."""
  exact = compiled.get((model, seq_len, block_size, strategy))
  if exact is not None:
    return exact
  return next((v for (m, n, _, s), v in compiled.items() if (m, n, s) == (model, seq_len,
                                                                           strategy)), None)
