"""What one rank computes, holds and sends for a Gated DeltaNet layer (docs/gdn.md), under
this package's program or the seed's head-parallel layout.

  chain    parallel/recurrence.py: each rank's clean segments' (M, N) (a delta-rule pass with
           values [v | 0]), a chain of one-state hops in position order, tails all-gathered
           for the conv, fetched copies of clean segments where blocks live elsewhere (cp_*),
           and the rerun of every segment and block from its entry state. Traffic is
           `step_report.recurrence_traffic`'s, converted to wire bytes (`chain_wire_bytes`).
  ulysses  the seed's (Turbo-dLLM 0.1.6, `core/models/backbones/qwen3_8/context_parallel.py`;
           docs/gdn.md): an all-to-all
           of each rank's clean q, k, v, z, b, a to head shards, a full-length recurrence per
           head shard, an all-to-all of the outputs back, and one of each block's boundary
           state (and conv rows) to the rank that holds the block. Registered here only, as
           the cost model's baseline, not as a training strategy.

FLOPs: 2 per multiply-add of a dense matmul, c(c-1) per right-hand column of a c-row unit
lower-triangular solve; elementwise work (decays, gates, L2 and gated norms) is left out.
The projections are the model's linear layers (`metrics.gdn_projection_weights`), timed
with them.
"""

import dataclasses

import jax.numpy as jnp

from bdlm_jax.analysis.cost_model.work import bd3lm_config
from bdlm_jax.analysis.hlo_stats import wire_bytes
from bdlm_jax.analysis.step_report import recurrence_traffic
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.delta_rule import CHUNK
from bdlm_jax.metrics import gdn_projection_weights
from bdlm_jax.models.pattern import gdn_shape, layer_types
from bdlm_jax.parallel import recurrence
from bdlm_jax.parallel.layout import LayoutPlan

CHAIN, ULYSSES = "chain", "ulysses"
F32 = 4


@dataclasses.dataclass(frozen=True)
class GdnLayer:
  """One rank's forward of one GDN layer: FLOPs by part, and the f32 state bytes its
  backward keeps."""
  projection: float  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
  conv: float  # the depthwise causal conv over [q | k | v]
  intra: float  # the delta rule's in-chunk terms (no state)
  inter: float  # its state terms, chunk to chunk
  transfer: float  # the chain's (M, N) pass, intra + inter with values [v | 0]
  apply: float  # the chain's M S + N steps
  state_bytes: float

  @property
  def core(self) -> float:
    """FLOPs beside the projections: what runs at the delta rule's rate."""
    return self.conv + self.intra + self.inter + self.transfer + self.apply


def gdn_layers(m: ModelConfig) -> int:
  return layer_types(m).count("gdn")


def state_bytes(m: ModelConfig) -> int:
  """One f32 state [Hv, K, V]."""
  _, hv, dk, dv = gdn_shape(m)
  return hv * dk * dv * F32


def conv_channels(m: ModelConfig) -> int:
  """Pre-conv [q | k | v] channels."""
  hk, hv, dk, dv = gdn_shape(m)
  return 2 * hk * dk + hv * dv


def delta_rule_flops(rows: int, dk: int, dv: int) -> tuple[int, int]:
  """(intra, inter) forward FLOPs of one value head's `kernels.delta_rule.chunked` call over
  `rows` rows, values of width `dv`, in chunks of c = min(CHUNK, rows), padded up as the
  kernel pads. Per chunk, intra: k_beta k^T and q k^T (2c^2 K each), the solves for w and u
  (c(c-1) per column: K + V columns), attn v_new (2c^2 V); inter: w S, q S, k^T v_new
  (2cKV each)."""
  c = min(CHUNK, rows)
  n = -(-rows // c)
  return (n * (4 * c * c * dk + c * (c - 1) * (dk + dv) + 2 * c * c * dv),
          n * 6 * c * dk * dv)


def _calls_flops(calls, dk: int, dv: int) -> tuple[int, int]:
  """(intra, inter) `delta_rule_flops` of `calls` [(rows, heads)]."""
  parts = [tuple(heads * f for f in delta_rule_flops(rows, dk, dv)) for rows, heads in calls]
  return (sum(p[0] for p in parts), sum(p[1] for p in parts))


def _layer(m: ModelConfig, plan: LayoutPlan, calls, transfer_calls=(), chain_steps: int = 0,
           kept_states: float = 0.0) -> GdnLayer:
  """`GdnLayer` of delta-rule `calls` [(rows, heads)] (the conv runs over the same rows),
  `transfer_calls` of the (M, N) pass, and `chain_steps` applies of (M, N)."""
  _, hv, dk, dv = gdn_shape(m)
  intra, inter = _calls_flops(calls, dk, dv)
  transfer = sum(_calls_flops(transfer_calls, dk, dv + dk))
  conv_rows = sum(rows * h / hv for rows, h in [*calls, *transfer_calls])
  return GdnLayer(projection=plan.rows_per_rank * 2 * gdn_projection_weights(m),
                  conv=conv_rows * 2 * conv_channels(m) * m.gdn_conv,
                  intra=intra, inter=inter, transfer=transfer,
                  apply=chain_steps * hv * 2 * dk * dk * dv, state_bytes=kept_states)


def chain_layer(m: ModelConfig, plan: LayoutPlan) -> GdnLayer:
  """Under `stream_program(plan)`: the (M, N) pass over the segments the chain reads, the
  chain's applies (every rank computes each), and the rerun, one call of B rows a scan step
  for each work segment (own and fetched) and one for the block beside it (a zero block
  where none: it is computed all the same). Kept: one state a scan step and work segment
  (the scan's backward; docs/gdn.md) and the (M, N) pairs."""
  program = stream_program(m, plan)
  _, hv, dk, dv = gdn_shape(m)
  work = program.src.shape[1]
  segment = program.steps * program.unit
  transfers = len(program.transfer_segs) if program.chain else 0
  kept = (work * program.steps * state_bytes(m)
          + transfers * hv * dk * (dk + dv) * F32)
  return _layer(m, plan, [(program.unit, hv)] * (2 * work * program.steps),
                [(segment, hv)] * transfers, len(program.chain), kept)


def ulysses_layer(m: ModelConfig, plan: LayoutPlan) -> GdnLayer:
  """The seed's: the clean stream's full length on Hv/P heads, then each of the rank's
  corrupted blocks on every head from its boundary state. Kept: the boundary states of
  every block on its heads (stored at chunk starts) and those of its own blocks."""
  p = plan.num_ranks
  hk, hv, _, _ = gdn_shape(m)
  if hk % p or hv % p:
    raise ConfigError(f"the head-parallel GDN needs parallel.seq={p} to divide the key and "
                      f"value heads ({hk}, {hv})")
  b = plan.block_size
  blocks = plan.n_noisy // b
  kept = (plan.seq_len // b / p + blocks) * state_bytes(m)
  return _layer(m, plan, [(plan.seq_len, hv // p)] + [(b, hv)] * blocks, kept_states=kept)


def layer_work(m: ModelConfig, plan: LayoutPlan, transport: str) -> GdnLayer:
  return {CHAIN: chain_layer, ULYSSES: ulysses_layer}[transport](m, plan)


def stream_program(m: ModelConfig, plan: LayoutPlan) -> recurrence.StreamProgram:
  return recurrence.stream_program(plan, m.gdn_conv - 1)


def stream_config(m: ModelConfig, plan: LayoutPlan) -> Config:
  """One sequence of `m` laid out by `plan`: what `recurrence_traffic` reads."""
  return replace(bd3lm_config(m, plan.seq_len, plan.block_size),
                 parallel=dict(strategy=plan.strategy, seq=plan.num_ranks))


def chain_traffic(m: ModelConfig, plan: LayoutPlan, reruns: int) -> dict:
  """`recurrence_traffic` per device and step, operand bytes by kind (pre-conv rows in the
  compute dtype; states, g and beta in f32)."""
  return recurrence_traffic(stream_config(m, plan), reruns=reruns)


def chain_wire_bytes(m: ModelConfig, plan: LayoutPlan, reruns: int) -> float:
  """Bytes the mean rank sends a step for its GDN layers: `chain_traffic` as ring algorithms
  send it (`wire_bytes`), but for the chain. Each chain hop compiles to a collective-permute
  every rank runs, and `recurrence_traffic` counts its state on every rank (operand bytes,
  hlo_stats' convention); only one of the P ranks sends it, so of the chain's operand bytes
  (2 + reruns passes of its hops' states a layer) the mean rank sends 1/P. Fetched copies
  are counted as sent by every rank (exact on cp_*, where each rank fetches one)."""
  traffic = chain_traffic(m, plan, reruns)
  p = plan.num_ranks
  traffic["collective-permute"] -= chain_operand_bytes(m, plan, reruns) * (1 - 1 / p)
  return wire_bytes(traffic, p)


def chain_hops(m: ModelConfig, plan: LayoutPlan) -> list[tuple[int, int]]:
  """(from rank, to rank) of each chain step, in order (equal: a step on one rank)."""
  return [(q, r) for r, _, q, _ in stream_program(m, plan).chain]


def chain_pass_bytes(m: ModelConfig, plan: LayoutPlan) -> tuple[float, float]:
  """(tails, fetched) bytes a rank sends in one forward pass of one GDN layer, read off
  `chain_traffic` (no rerun: one pass forward, one back): its segments' tails it
  all-gathers, and the copies' rows and entry states it permutes beside the chain's."""
  traffic, n = chain_traffic(m, plan, reruns=0), gdn_layers(m)
  chain = chain_operand_bytes(m, plan, reruns=0) / n
  return traffic["all-gather"] / n, (traffic["collective-permute"] / n - chain) / 2


def chain_operand_bytes(m: ModelConfig, plan: LayoutPlan, reruns: int) -> float:
  """Operand bytes per device the chain's permutes count in `recurrence_traffic`: a state a
  hop, forward (1 + reruns passes) and backward, every GDN layer."""
  hops = sum(q != r for q, r in chain_hops(m, plan))
  return gdn_layers(m) * (2 + reruns) * hops * state_bytes(m)


def ulysses_bytes(m: ModelConfig, plan: LayoutPlan) -> tuple[float, ...]:
  """(in, out, states) bytes each rank puts into the seed's three all-to-alls of one layer's
  forward: its clean rows' q, k, v, z, b, a; their outputs [Hv V]; its blocks' boundary
  states with their conv rows (`gdn_conv` - 1 pre-conv rows); activations in the compute
  dtype. The backward sends as much the other way."""
  hk, hv, dk, dv = gdn_shape(m)
  e = jnp.dtype(m.compute_dtype).itemsize
  rows = plan.rows_per_rank - plan.n_noisy
  blocks = plan.n_noisy // plan.block_size
  return (rows * (2 * hk * dk + 2 * hv * dv + 2 * hv) * e,
          rows * hv * dv * e,
          blocks * (state_bytes(m) + (m.gdn_conv - 1) * conv_channels(m) * e))


def ulysses_wire_bytes(m: ModelConfig, plan: LayoutPlan, reruns: int) -> float:
  """Bytes each rank sends a step: (P-1)/P of its all-to-all inputs, forward (1 + reruns
  passes) and backward, every GDN layer."""
  p = plan.num_ranks
  return (gdn_layers(m) * (2 + reruns) * (p - 1) / p
          * sum(ulysses_bytes(m, plan)))


def gdn_wire_bytes(m: ModelConfig, plan: LayoutPlan, transport: str, reruns: int) -> float:
  """Bytes each rank sends a step for its GDN layers under `transport`."""
  if not gdn_layers(m) or plan.num_ranks == 1:
    return 0.0
  return {CHAIN: chain_wire_bytes, ULYSSES: ulysses_wire_bytes}[transport](
      m, plan, reruns)
