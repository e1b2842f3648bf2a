"""Analytical step time and peak memory per sequence strategy, projected to the paper's
settings (16 H200 = 2 nodes x 8, 8B- and 27B-class dense models and a 30B-A3B-class
mixture of experts, 128K-1M tokens).

  python experiments/cost_model.py
  python experiments/cost_model.py --kernel-csv experiments/results/kernel_bench.csv

A plain model, not a simulator. Per rank and per step:

* Work comes from the strategy's real layout plan (`make_plan`): the (query, key) pairs each
  rank computes, split by whose K/V they read (its own *stay* K/V, or rank s's *travelling*
  K/V), so a ring can be timed step by step. Their sum per rank equals
  `LayoutPlan.attention_work()`. Each layer kind is costed apart (`layer_types`): a local
  layer of window W computes its windowed pairs (`attention_work(W)`) and moves K/V the way
  `window_transport` picks (the windowed exchange, exposed, or the global transport under a
  window mask). Linear layers cost rows x per-row FLOPs, as in
  `bdlm_jax.metrics.model_flops_per_step` (both checked by tests). A mixture of experts
  costs what a row uses, its router and k experts (*active* parameters), while its memory
  holds every expert (*total* parameters): `param_count(m, active=...)`.
* Time = FLOPs at achieved TFLOP/s + alpha-beta communication (NVLink inside a node,
  InfiniBand across; a ring that leaves a node moves at the InfiniBand hop's pace). A ring
  step hides its K/V hop under its compute, but each hop is a matched send/receive between
  neighbours, so a rank with little work at one step waits for its neighbours: the ring is
  timed step by step from each rank's work at that step. All-gather and reduce-scatter are
  exposed (attention needs the gathered K/V; the backward gathers them again). The bytes are
  what the transports issue (`bdlm_jax.parallel.step_report.attention_traffic`, per layer
  kind). An MoE's experts are split over all GPUs (`parallel.expert_axes=seq`): each layer
  sends every kept (token, expert) row to its expert's GPU and back, exposed
  (`moe_exchange`).
* Memory, where `experiments/scale_probe.py` compiled the setting (`--probe-csv`): the
  compiled per-device peak of the real train step, also for the other block sizes of that
  (model, L, strategy) (B moves memory only through layout padding). Elsewhere it is
  *assumed*: model states (ZeRO-3 over all GPUs) + what full remat saves per layer (the
  layer input, the attention output and its LSE, a local layer's exchanged K/V) + the largest
  transient (one layer's backward, or one loss chunk of `model.logits_chunk` rows). The
  report prints both figures and their ratio where both exist, and marks each fits / OOM
  verdict as compiled or assumed. gemma3-27b's compiled rows ran with every layer global
  (`load_probe`): a measured figure of the same model, kept in preference to the assumption,
  which reads about half the compiled peak for every model scale_probe compiled.

Every constant is in `Hardware` / `Assumptions` and is printed with the results.
"""

import argparse
import csv
import dataclasses
import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
sys.path.insert(0, ROOT)

from bdlm_jax.config import ModelConfig, layer_types, mlp_types  # noqa: E402
from bdlm_jax.models.moe import capacity  # noqa: E402
from bdlm_jax.parallel.hlo_stats import COLLECTIVE_KINDS, wire_bytes  # noqa: E402
from bdlm_jax.parallel.layout import PAD, LayoutPlan, make_plan  # noqa: E402
from bdlm_jax.parallel.step_report import attention_traffic  # noqa: E402
from bdlm_jax.parallel.strategies import TRANSPORTS, exchange_for, window_transport  # noqa: E402

STRATEGIES = ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp", "csbp_allgather", "csbp_ring")
BASELINES = ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp")
TRANSPORT = {s: TRANSPORTS[s] for s in STRATEGIES}
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str = "16x H200 (2 nodes x 8, NVLink 4 + 8x400G NDR InfiniBand per node)"
  nodes: int = 2
  gpus_per_node: int = 8
  peak_tflops: float = 989.0  # dense bf16 peak, for MFU
  matmul_tflops: float = 600.0  # achieved dense bf16 GEMM (~60% of the 989 TFLOP/s peak)
  attention_tflops: float = 400.0  # achieved flash attention fwd+bwd, tiles skipped (FA3-class)
  nvlink_gb_s: float = 360.0  # achieved GPU->GPU, one direction (900 GB/s bidirectional link)
  nvlink_alpha_us: float = 10.0
  ib_gb_s: float = 45.0  # achieved per GPU, one direction (one 400 Gb/s NIC per GPU)
  ib_alpha_us: float = 25.0
  hbm_gb: float = 141.0
  usable_fraction: float = 0.95  # what the allocator may use

  @property
  def num_gpus(self) -> int:
    return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Assumptions:
  tile_skipping: bool = True  # kernel skips fully masked tiles (False: every pair of each visit)
  ring_overlap: bool = True  # a ring hop hides under the same step's compute
  balanced_ring_steps: bool = False  # True: every rank's ring step takes its mean step time
  compute_bytes: int = 2  # bf16 activations, q/k/v and the all-gather/reduce-scatter payloads
  kv_grad_bytes: int = 4  # dK/dV travel in f32 (parallel.kv_grad_dtype), ring or all-gather
  meta_bytes_per_row: int = 12  # stream, block, segment (int32) travel with each K/V row
  state_bytes_per_param: int = 16  # f32 params + f32 grads + Adam m and v
  attention_bwd_factor: float = 2.5  # flash backward = 2.5x forward (recomputes the scores)
  remat_forward: int = 1  # full remat re-runs each layer's linear forward once in the backward


# Shapes of the paper-class models in bdlm_jax's Llama-style block (Gemma 3 27B's dimensions,
# qk_norm, vocabulary and 5:1 local:global layers of window 1024, local RoPE base 10K; its
# GeGLU and sandwich norms are not modelled; Qwen3-30B-A3B's, every layer a mixture of
# experts, whose experts take at most 1.25x their fair share of a group's rows, so that the
# expert-parallel receive buffers are sized by that capacity, not by the worst case of every
# row at one GPU).
# mask_token_id only has to be a valid id.
MODELS = {
    "llama3-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500000.0,
                             tie_embeddings=False, compute_dtype="bfloat16"),
    "gemma3-27b": ModelConfig(vocab_size=262208, d_model=5376, n_layers=62, n_heads=32,
                              n_kv_heads=16, head_dim=128, d_ff=21504, rope_theta=1e6,
                              qk_norm=True, tie_embeddings=True, compute_dtype="bfloat16",
                              layer_pattern="local,local,local,local,local,global",
                              sliding_window=1024, rope_local_theta=10000.0),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, d_ff=6144, moe_experts=128,
                                 moe_top_k=8, moe_d_ff=768, moe_norm_topk=True,
                                 moe_drop_tokens=True, moe_capacity_factor=1.25,
                                 rope_theta=1e6, qk_norm=True, tie_embeddings=False,
                                 compute_dtype="bfloat16"),
}
SEQ_LENS = (128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024)
BLOCK_SIZES = (16, 64, 256)

# The paper's headline figures (CSBP over the best baseline).
PAPER = (
    dict(claim="SFT", seq_len=256 * 1024, low=1.18, high=1.45, hardware="16x H200"),
    dict(claim="AR->BDLM conversion", seq_len=256 * 1024, low=1.27, high=1.33,
         hardware="16x H200"),
    dict(claim="BDLM training", seq_len=512 * 1024, low=1.61, high=1.61, hardware="16x H200"),
    dict(claim="DFlash2 drafter", seq_len=512 * 1024, low=2.48, high=2.48, hardware="8x H100"),
    dict(claim="DFlash2 drafter", seq_len=1024 * 1024, low=7.59, high=7.59, hardware="8x H100"),
)


# ----------------------------------------------------------------------------- model shapes

def _mlp_params(m: ModelConfig, active: bool) -> int:
  """One layer's SwiGLU MLP: dense, or an MoE's router and its experts (all E, or the k one
  row uses). The model's layers are all alike: a dense/MoE `mlp_pattern` is not modelled."""
  if len(set(mlp_types(m))) > 1:
    raise ValueError(f"the cost model takes every layer dense or every layer MoE, not "
                     f"model.mlp_pattern={m.mlp_pattern!r}")
  if not m.moe_experts:
    return 3 * m.d_model * m.d_ff
  experts = m.moe_top_k if active else m.moe_experts
  return m.d_model * m.moe_experts + experts * 3 * m.d_model * (m.moe_d_ff or m.d_ff)


def expert_params(m: ModelConfig) -> int:
  """Every layer's expert weights: under expert parallelism they stay where they are used
  (never gathered by ZeRO-3, their gradients never reduced)."""
  return m.n_layers * (_mlp_params(m, False) - m.d_model * m.moe_experts) if m.moe_experts else 0


def layer_flops_per_row(m: ModelConfig) -> float:
  """Forward FLOPs of one row through one layer's projections and SwiGLU MLP (of an MoE, the
  router and the k experts the row uses: active parameters)."""
  qkv = 2 * m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
  return qkv + 2 * m.n_heads * m.head_dim * m.d_model + 2 * _mlp_params(m, active=True)


def param_count(m: ModelConfig, active: bool = False) -> int:
  """Total parameters (what memory holds), or with `active` those one token computes with
  (an MoE's router and k experts; the same as total for a dense model)."""
  per_layer = (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
               + m.n_heads * m.head_dim * m.d_model + _mlp_params(m, active) + 2 * m.d_model
               + (2 * m.head_dim if m.qk_norm else 0))
  embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
  return embed + m.n_layers * per_layer + m.d_model


def attention_kinds(m: ModelConfig) -> list[tuple[int | None, int]]:
  """(window, layer count) of each attention kind the model has: None for its global layers,
  `sliding_window` for its local ones (`layer_types`)."""
  kinds = layer_types(m)
  return [(window, n) for window, n in ((None, kinds.count("global")),
                                        (m.sliding_window, kinds.count("local"))) if n]


def useful_flops(m: ModelConfig, seq_len: int, block_size: int) -> float:
  """Useful FLOPs of one sequence's step (3x forward), as `model_flops_per_step` counts
  (a local layer: its windowed pairs)."""
  plan = make_plan("none", seq_len, block_size, 1)
  attention = sum(n * 4 * float(plan.attention_work(window).sum()) * m.n_heads * m.head_dim
                  for window, n in attention_kinds(m))
  forward = (2 * seq_len * m.n_layers * layer_flops_per_row(m)
             + 2 * seq_len * m.d_model * m.vocab_size
             + attention)
  return 3 * forward


# ----------------------------------------------------------------------------- plan -> work

def _histograms(rows: np.ndarray, seq_len: int, block_size: int) -> np.ndarray:
  """int64 [P, 2, N]: rows of each (stream, block) per rank (stream 0 noisy, 1 clean)."""
  p, n = rows.shape[0], seq_len // block_size
  valid = rows != PAD
  cell = (rows >= seq_len) * n + (rows % seq_len) // block_size + 2 * n * np.arange(p)[:, None]
  return np.bincount(cell[valid], minlength=2 * n * p).reshape(p, 2, n).astype(np.int64)


def _allowed_pairs(q_hist: np.ndarray, k_hist: np.ndarray) -> np.ndarray:
  """[Pq, Pk] allowed (query, key) pairs between row groups, from the DESIGN section 2 mask:
  noisy->noisy same block, noisy->clean earlier blocks, clean->clean same or earlier."""
  kc = k_hist[:, 1]
  kc_before = np.cumsum(kc, axis=1) - kc
  noisy_keys = k_hist[:, 0] + kc_before
  return q_hist[:, 0] @ noisy_keys.T + q_hist[:, 1] @ np.cumsum(kc, axis=1).T


@dataclasses.dataclass(frozen=True)
class PlanWork:
  """What one plan asks of each rank, independent of the model."""
  plan: LayoutPlan
  stay_pairs: np.ndarray  # int64 [P]: queries of rank r x its stay K/V
  travel_pairs: np.ndarray  # int64 [P, P]: queries of rank r x travelling K/V of rank s
  n_stay: int  # local K/V rows that never travel
  n_travel: int  # K/V rows each rank sends

  def executed(self, tile_skipping: bool):
    """(stay [P], travel [P, P]) pairs the kernel computes: only allowed pairs when it skips
    masked tiles, else every pair of each visit that has any allowed pair."""
    if tile_skipping:
      return self.stay_pairs, self.travel_pairs
    rows = self.plan.rows_per_rank
    return (np.where(self.stay_pairs > 0, rows * self.n_stay, 0),
            np.where(self.travel_pairs > 0, rows * self.n_travel, 0))


def plan_work(strategy: str, seq_len: int, block_size: int, num_ranks: int) -> PlanWork:
  plan = make_plan(strategy, seq_len, block_size, num_ranks)
  split = {"all": 0, "clean": plan.n_noisy, "none": plan.rows_per_rank}[plan.travel]
  q = _histograms(plan.rows, seq_len, block_size)
  stay = _histograms(plan.rows[:, :split], seq_len, block_size)
  travel = _histograms(plan.rows[:, split:], seq_len, block_size)
  stay_pairs = np.einsum("rr->r", _allowed_pairs(q, stay))
  return PlanWork(plan, stay_pairs, _allowed_pairs(q, travel), split,
                  plan.rows_per_rank - split)


# ----------------------------------------------------------------------------- time

def _hop_s(nbytes: float, hw: Hardware, num_ranks: int) -> float:
  """One ring hop, at the slowest link's pace (InfiniBand once the ring leaves a node)."""
  if num_ranks == 1:
    return 0.0  # a one-rank ring keeps everything in place
  if num_ranks > hw.gpus_per_node:
    return hw.ib_alpha_us * 1e-6 + nbytes / (hw.ib_gb_s * GB)
  return hw.nvlink_alpha_us * 1e-6 + nbytes / (hw.nvlink_gb_s * GB)


def _ring_s(start: np.ndarray, compute: np.ndarray, kv_hop: float, grad_hop: float,
            overlap: bool) -> float:
  """Seconds until every rank finishes the ring; `compute` [P, P] is rank r's work at step s.

  Each ppermute is a matched send/receive with both ring neighbours, so a rank's step s+1
  starts when its own compute is done and the K/V shift (issued at the start of step s)
  has completed on it and its neighbours. Step s forwards the K/V (all but the last step);
  the backward (grad_hop > 0) then passes the dK/dV accumulators on, after the compute that
  updates them (our ring's scan step holds both). Without overlap the shift runs first.
  """
  neighbours = lambda t: np.maximum(np.maximum(t, np.roll(t, 1)), np.roll(t, -1))
  steps = compute.shape[1]
  for s in range(steps):
    kv_done = neighbours(start) + kv_hop if s < steps - 1 else start
    done = np.maximum(start + compute[:, s], kv_done) if overlap else kv_done + compute[:, s]
    start = neighbours(done) + grad_hop if grad_hop else done
  return float(start.max())


def expert_slots(m: ModelConfig, rows: int, num_gpus: int) -> tuple[int, int]:
  """(pairs, receive slots) of one GPU's MoE layer, experts split over `num_gpus`
  (`parallel.experts`): its rows' k (token, expert) pairs, and the rows its experts may
  receive, the group's pairs bounded by their capacity (`models.moe.capacity`)."""
  pairs = rows * m.moe_top_k
  cap = capacity(m, num_gpus * rows)
  group = num_gpus * pairs
  return pairs, group if cap is None else min(group, m.moe_experts // num_gpus * cap)


def moe_exchange(m: ModelConfig, rows: int, hw: Hardware, a: Assumptions) -> tuple[float, float]:
  """(bytes, seconds) per GPU and step of an MoE's token exchange, experts split over every
  GPU: per layer each of the rows' k (token, expert) pairs goes to its expert's GPU (d_model
  in the compute dtype) and its output comes back; in the forward, again in the remat's
  forward, and in the backward (the gradients, the reverse way). The router is taken as
  balanced (every pair kept, a 1/G share staying on its GPU); the exchange is exposed (the
  MLP waits for its rows), its inter-node share on InfiniBand alongside the NVLink share."""
  g = hw.num_gpus
  if not m.moe_experts or g == 1:
    return 0.0, 0.0
  one_way = rows * m.moe_top_k * m.d_model * a.compute_bytes
  exchanges = m.n_layers * 2 * (2 + a.remat_forward)
  nvlink = one_way * (min(g, hw.gpus_per_node) - 1) / g / (hw.nvlink_gb_s * GB)
  if g > hw.gpus_per_node:
    seconds = hw.ib_alpha_us * 1e-6 + max(
        nvlink, one_way * (g - hw.gpus_per_node) / g / (hw.ib_gb_s * GB))
  else:
    seconds = hw.nvlink_alpha_us * 1e-6 + nvlink
  return exchanges * one_way, exchanges * seconds


def _attention_s(m: ModelConfig, work: PlanWork, stay: np.ndarray, travel: np.ndarray,
                 hw: Hardware, a: Assumptions) -> tuple[float, float, float]:
  """(forward, backward, busiest rank's compute) seconds of one layer on the plan's own
  transport, each rank computing `stay` [P] + `travel` [P, P] (query, key) pairs."""
  p = work.plan.num_ranks
  kv_row = 2 * m.n_kv_heads * m.head_dim  # K and V elements of one row
  attn_s_per_pair = 4 * m.n_heads * m.head_dim / (hw.attention_tflops * 1e12)
  stay_s = stay * attn_s_per_pair
  bwd = a.attention_bwd_factor
  kv_bytes = work.n_travel * (kv_row * a.compute_bytes + a.meta_bytes_per_row)
  transport = TRANSPORT[work.plan.strategy]
  if transport == "ring":
    # Step s: rank r works on the K/V of rank (r - s) % P (the ring shifts i -> i+1).
    ranks = np.arange(p)
    compute = np.stack([travel[ranks, (ranks - s) % p] for s in range(p)], axis=1)
    compute = compute * attn_s_per_pair
    if a.balanced_ring_steps:
      compute = np.repeat(compute.mean(axis=1, keepdims=True), p, axis=1)
    kv_hop = _hop_s(kv_bytes, hw, p)
    grad_hop = _hop_s(work.n_travel * kv_row * a.kv_grad_bytes, hw, p)
    attn_fwd = _ring_s(stay_s, compute, kv_hop, 0.0, a.ring_overlap)
    attn_bwd = _ring_s(bwd * stay_s, bwd * compute, kv_hop, grad_hop, a.ring_overlap)
    busy = (stay_s + compute.sum(axis=1)).max()
  else:
    busy = (stay_s + travel.sum(axis=1) * attn_s_per_pair).max()
    gather = scatter = 0.0
    if transport == "allgather":  # NCCL ring gather / scatter, exposed
      gather = (p - 1) * _hop_s(kv_bytes, hw, p)
      scatter = (p - 1) * _hop_s(work.n_travel * kv_row * a.kv_grad_bytes, hw, p)
    attn_fwd, attn_bwd = busy + gather, bwd * busy + gather + scatter
  return attn_fwd, attn_bwd, busy


def _local_attention_s(m: ModelConfig, work: PlanWork, window: int, hw: Hardware,
                       a: Assumptions) -> tuple[float, float, float]:
  """`_attention_s` of a local layer of window W, on the transport `window_transport` picks.

  The windowed exchange: each rank computes its windowed pairs (`attention_work(W)`; without
  tile skipping its queries x [own ; received] rows), after one exposed `ppermute` per ring
  distance carrying K/V + metadata; the backward returns their dK/dV (K/V's dtype) the
  reverse way, and reuses the received rows that remat saved. On the global transport (or
  none, `bp`) with a window mask: that transport's timing with each rank's pairs scaled to
  its windowed share (the plan gives windowed pairs per rank, not per K/V owner; without
  tile skipping, the global visits' pairs, a mask-unaware kernel skipping no window)."""
  plan = work.plan
  windowed = plan.attention_work(window)
  if window_transport(plan, window) != "exchange":
    stay, travel = work.executed(a.tile_skipping)
    if a.tile_skipping:
      full = plan.attention_work()
      share = np.divide(windowed, full, out=np.zeros(len(full)), where=full > 0)
      stay, travel = stay * share, travel * share[:, None]
    return _attention_s(m, work, stay, travel, hw, a)
  exchange = exchange_for(plan, window)
  rows = plan.rows_per_rank
  pairs = windowed if a.tile_skipping else rows * (rows + exchange.rows_sent())
  busy = np.max(pairs) * 4 * m.n_heads * m.head_dim / (hw.attention_tflops * 1e12)
  kv_row = 2 * m.n_kv_heads * m.head_dim
  hops = lambda row_bytes: sum(_hop_s(send.shape[1] * row_bytes, hw, plan.num_ranks)
                               for send in exchange.send)
  bwd = a.attention_bwd_factor
  return (busy + hops(kv_row * a.compute_bytes + a.meta_bytes_per_row),
          bwd * busy + hops(kv_row * a.compute_bytes), busy)


def step_time(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions) -> dict:
  """Seconds of one step (one sequence over the seq ranks), and where they go; each layer
  kind (global, local of window W) timed on its own transport."""
  attention = busy = 0.0
  for window, n in attention_kinds(m):
    if window is None:
      attn_fwd, attn_bwd, layer_busy = _attention_s(m, work, *work.executed(a.tile_skipping),
                                                    hw, a)
    else:
      attn_fwd, attn_bwd, layer_busy = _local_attention_s(m, work, window, hw, a)
    attention += n * (attn_fwd + attn_bwd)
    busy += n * (1 + a.attention_bwd_factor) * layer_busy
  rows = work.plan.rows_per_rank  # padding rows run through the linear layers too
  linear = rows * layer_flops_per_row(m) * (3 + a.remat_forward) / (hw.matmul_tflops * 1e12)
  logits = 3 * 2 * work.plan.n_noisy * m.d_model * m.vocab_size / (hw.matmul_tflops * 1e12)
  moe_bytes, moe_s = moe_exchange(m, rows, hw, a)
  return dict(total_s=m.n_layers * linear + logits + attention + moe_s,
              attention_s=attention, linear_s=m.n_layers * linear + logits,
              attention_busy_s=busy,
              comm_bytes_per_step=step_comm_bytes(work, m, a),
              moe_exchange_s=moe_s, moe_exchange_bytes=moe_bytes)


def step_comm_bytes(work: PlanWork, m: ModelConfig, a: Assumptions) -> float:
  """Bytes each rank sends for attention in one step: what the transport issues per layer
  kind (`attention_traffic`: the ring shifts K/V + metadata P-1 times forward and P-1 times
  backward and the dK/dV P times; the all-gather gathers K/V + metadata forward and again
  backward and reduce-scatters the dK/dV; a local layer's windowed exchange sends the rows
  its windows reach and takes their dK/dV back), as ring algorithms send it (`wire_bytes`)."""
  kv_row = 2 * m.n_kv_heads * m.head_dim
  totals = [attention_traffic(work.plan, kv_row * a.compute_bytes, kv_row * a.kv_grad_bytes,
                              a.meta_bytes_per_row, n, window)
            for window, n in attention_kinds(m)]
  traffic = {kind: sum(t[kind] for t in totals) for kind in COLLECTIVE_KINDS}
  return wire_bytes(traffic, work.plan.num_ranks)


def param_traffic_s(m: ModelConfig, hw: Hardware, a: Assumptions) -> float:
  """ZeRO-3 weight traffic per step (gather bf16 twice, reduce-scatter f32 grads), the same
  for every strategy and assumed hidden under the linear layers' compute; an MoE's experts,
  split over the GPUs, do not move."""
  n = (param_count(m) - expert_params(m)) * (hw.num_gpus - 1) / hw.num_gpus
  return n * (2 * a.compute_bytes + 4) / (hw.ib_gb_s * GB)


# ----------------------------------------------------------------------------- memory

def peak_memory(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions) -> dict:
  """Bytes per rank, assumed: states + saved activations + the largest transient buffer, of
  the layer kind (global, local of window W) that needs the most."""
  e = a.compute_bytes
  rows = work.plan.rows_per_rank
  kv_row = 2 * m.n_kv_heads * m.head_dim
  q_row = m.n_heads * m.head_dim
  states = param_count(m) * a.state_bytes_per_param / hw.num_gpus
  # Saved per layer (full remat, `models.transformer.remat_policy`): the layer input and the
  # attention core's output and LSE, and a local layer's exchanged K/V rows with their
  # metadata; q, K/V and any gathered K/V are recomputed.
  saved_layer = rows * ((m.d_model + q_row) * e + 4 * m.n_heads)
  # Transient while one layer runs its backward: recomputed MLP/projections and their
  # gradients, the f32 dq, and the K/V buffers in flight with their f32 gradients. An MoE's
  # MLP runs on its experts' received rows: they, the rows sent and received back, and the
  # experts' intermediates (`parallel.experts`, ragged_all_to_all dispatch).
  if m.moe_experts:
    pairs, slots = expert_slots(m, rows, hw.num_gpus)
    mlp = slots * 3 * (m.moe_d_ff or m.d_ff) + 2 * (pairs + slots) * m.d_model
  else:
    mlp = rows * 3 * m.d_ff
  linear_tmp = 2 * (mlp + rows * (m.d_model + q_row + kv_row // 2)) * e + rows * q_row * 4
  if TRANSPORT[work.plan.strategy] == "ring":
    kv_tmp = 2 * work.n_travel * kv_row * (e + a.kv_grad_bytes)  # current + next, kv + dkv
  else:  # every visible key's K/V and f32 dK/dV (the all-gather gathers all ranks' part)
    gathered = work.plan.num_ranks * work.n_travel
    kv_tmp = (work.n_stay + gathered) * kv_row * (e + 4)
  saved = transient = 0
  for window, n in attention_kinds(m):
    layer_saved, layer_kv = saved_layer, kv_tmp
    if window is not None and window_transport(work.plan, window) == "exchange":
      received = exchange_for(work.plan, window).rows_sent()
      layer_saved += received * (kv_row * e + a.meta_bytes_per_row)
      layer_kv = (rows + received) * kv_row * 2 * e  # [own ; received] K/V and their dK/dV
    saved += n * layer_saved
    transient = max(transient, linear_tmp + layer_kv)
  chunk = min(m.logits_chunk or work.plan.n_noisy, work.plan.n_noisy)  # loss.chunked_loss
  logits_tmp = 2 * chunk * m.vocab_size * 4
  transient = max(transient, logits_tmp)
  total = states + saved + transient
  return dict(total_bytes=total, states_bytes=states, saved_bytes=saved,
              transient_bytes=transient)


# ----------------------------------------------------------------------------- projection

def load_probe(path: str, hw: Hardware) -> dict:
  """{(model, L, B, strategy): compiled peak bytes} from a scale_probe CSV: full-depth rows
  of this cost model's models on `hw.num_gpus` devices that compiled; of an MoE, the
  ragged dispatch (the GPU's) compiled with stand-ins, not the all_gather one XLA:CPU runs.
  The CSV does not record the layer pattern: its gemma3-27b rows were compiled with every
  layer global, and are used as that model's memory (see the module docstring)."""
  with open(path) as f:
    rows = list(csv.DictReader(f))
  return {(r["model"], int(r["seq_len"]), int(r["block_size"]), r["strategy"]):
          float(r["peak_bytes"]) for r in rows
          if r["model"] in MODELS and not r["error"] and not r["depth_check"]
          and not r.get("overrides")
          and (r.get("standins") == "True") == bool(MODELS[r["model"]].moe_experts)
          and int(r["devices"]) == hw.num_gpus and r["remat"] == "full"
          and int(r["layers"]) == MODELS[r["model"]].n_layers}


def compiled_peak(compiled: dict, model: str, seq_len: int, block_size: int, strategy: str):
  """The compiled peak of this setting, else of the same (model, L, strategy) compiled at
  another block size, else None."""
  exact = compiled.get((model, seq_len, block_size, strategy))
  if exact is not None:
    return exact
  return next((v for (m, n, _, s), v in compiled.items() if (m, n, s) == (model, seq_len,
                                                                           strategy)), None)


def project(hw: Hardware, scenarios: dict, models=MODELS, seq_lens=SEQ_LENS,
            block_sizes=BLOCK_SIZES, strategies=STRATEGIES, compiled=None) -> dict:
  """{scenario: one row per (model, L, B, strategy)}; each plan is built once. `mfu` is the
  useful FLOPs (`useful_flops`) over the step time at peak on every GPU. `memory_bytes` (and
  the fits verdict) is the compiled peak where `compiled` (`load_probe`) has the setting,
  else the assumed `total_bytes`."""
  compiled = compiled or {}
  out = {name: [] for name in scenarios}
  for seq_len in seq_lens:
    for block_size in block_sizes:
      useful = {name: useful_flops(m, seq_len, block_size) for name, m in models.items()}
      for s in strategies:
        work = plan_work(s, seq_len, block_size, hw.num_gpus)
        for scenario, a in scenarios.items():
          for name, m in models.items():
            row = dict(model=name, seq_len=seq_len, block_size=block_size, strategy=s,
                       **step_time(m, work, hw, a), **peak_memory(m, work, hw, a))
            row["compiled_bytes"] = compiled_peak(compiled, name, seq_len, block_size, s)
            row["compiled_here"] = (name, seq_len, block_size, s) in compiled
            row["memory_bytes"] = row["compiled_bytes"] or row["total_bytes"]
            row["fits"] = row["memory_bytes"] <= hw.hbm_gb * GB * hw.usable_fraction
            row["mfu"] = useful[name] / (row["total_s"] * hw.num_gpus * hw.peak_tflops * 1e12)
            out[scenario].append(row)
  return out


def _idle_fraction(row: dict | None) -> float | None:
  """Share of the step spent communicating (an MoE's token exchange too) or waiting for ring
  neighbours."""
  if row is None:
    return None
  return (row["attention_s"] - row["attention_busy_s"] + row["moe_exchange_s"]) / row["total_s"]


def speedups(rows: list[dict]) -> list[dict]:
  """Per (model, L, B): best CSBP over the best baseline, each among strategies that fit."""
  out = []
  keys = sorted({(r["model"], r["seq_len"], r["block_size"]) for r in rows},
                key=lambda k: (list(MODELS).index(k[0]), k[1], k[2]))
  for key in keys:
    group = [r for r in rows if (r["model"], r["seq_len"], r["block_size"]) == key]
    fit = lambda names: [r for r in group if r["strategy"] in names and r["fits"]]
    base = min(fit(BASELINES), key=lambda r: r["total_s"], default=None)
    csbp = min(fit(("csbp_ring", "csbp_allgather")), key=lambda r: r["total_s"], default=None)
    out.append(dict(model=key[0], seq_len=key[1], block_size=key[2],
                    baseline=base["strategy"] if base else None,
                    csbp=csbp["strategy"] if csbp else None,
                    speedup=base["total_s"] / csbp["total_s"] if base and csbp else None,
                    memory_ratio=csbp["memory_bytes"] / base["memory_bytes"]
                    if base and csbp else None,
                    baseline_idle=_idle_fraction(base), csbp_idle=_idle_fraction(csbp),
                    csbp_mfu=csbp["mfu"] if csbp else None))
  return out


SCENARIOS = {
    "default": Assumptions(),
    "balanced ring steps": Assumptions(balanced_ring_steps=True),
    "no ring overlap": Assumptions(ring_overlap=False),
    "no tile skipping": Assumptions(tile_skipping=False),
}


def calibrate(hw: Hardware, kernel_csv: str | None) -> tuple[Hardware, str]:
  """Attention TFLOP/s from experiments/kernel_bench.py output: the median useful TFLOP/s of
  our Pallas kernel, forward + backward, on BDLM masks (the work a training step does); the
  peers' rows and causal sanity rows say nothing about our step."""
  if not kernel_csv:
    return hw, f"attention TFLOP/s: assumed constant {hw.attention_tflops}"
  with open(kernel_csv) as f:
    records = list(csv.DictReader(f))
  values = [float(r["useful_tflops"]) for r in records
            if (r.get("peer"), r.get("mode"), r.get("mask")) == ("pallas", "fwd+bwd", "bdlm")
            and r.get("useful_tflops")]
  if not values:
    raise SystemExit(f"{kernel_csv}: no timed pallas fwd+bwd row on a bdlm mask (is it "
                     f"experiments/kernel_bench.py output from a GPU?)")
  tflops = statistics.median(values)
  return (dataclasses.replace(hw, attention_tflops=tflops),
          f"attention TFLOP/s: {tflops:.1f}, median useful TFLOP/s of {len(values)} pallas "
          f"fwd+bwd rows on BDLM masks in {kernel_csv}")


# ----------------------------------------------------------------------------- report

def _k(seq_len: int) -> str:
  return f"{seq_len // 1024}K" if seq_len < 1024 * 1024 else f"{seq_len // 1024 ** 2}M"


def _constants(hw: Hardware, a: Assumptions, calibration: str) -> list[str]:
  lines = ["Constants (every one an assumption; change them in `Hardware` / `Assumptions`):", ""]
  lines += [f"* hardware.{f.name} = {getattr(hw, f.name)}" for f in dataclasses.fields(hw)]
  lines += [f"* assumptions.{f.name} = {getattr(a, f.name)}" for f in dataclasses.fields(a)]
  lines += [f"* {calibration}", "* models:"]
  for name, m in MODELS.items():
    if not m.moe_experts:
      lines.append(f"  * {name}: {param_count(m) / 1e9:.2f}B params, d_model {m.d_model}, "
                   f"{m.n_layers} layers ({_layer_kinds(m)}), {m.n_heads} q / "
                   f"{m.n_kv_heads} kv heads x "
                   f"{m.head_dim}, d_ff {m.d_ff}, vocab {m.vocab_size}, tied embeddings "
                   f"{m.tie_embeddings}; ZeRO-3 weight traffic {param_traffic_s(m, hw, a):.1f} "
                   f"s per step, assumed hidden")
      continue
    lines += _moe_lines(name, m, hw, a)
  return lines + [""]


def _layer_kinds(m: ModelConfig) -> str:
  """How many layers of each attention kind, and what a local one sends."""
  kinds = layer_types(m)
  if set(kinds) == {"global"}:
    return "all global attention"
  return (f"{kinds.count('local')} local of window {m.sliding_window}, "
          f"{kinds.count('global')} global; a local layer's pairs are its window's, its K/V "
          f"move by the windowed exchange where that sends fewer rows than the global "
          f"transport, exposed, and its received rows are saved for the backward")


def _moe_lines(name: str, m: ModelConfig, hw: Hardware, a: Assumptions) -> list[str]:
  """An MoE's parameter counts, expert layout and token exchange, as assumed."""
  g, seq_len = hw.num_gpus, 256 * 1024
  rows = 2 * seq_len // g  # noisy and clean rows of one GPU
  pairs, slots = expert_slots(m, rows, g)
  one_way = pairs * m.d_model * a.compute_bytes
  sent, seconds = moe_exchange(m, rows, hw, a)
  return [
      f"  * {name}: {param_count(m) / 1e9:.2f}B params in total (memory: parameters, "
      f"gradients and Adam moments), {param_count(m, active=True) / 1e9:.2f}B active (FLOPs "
      f"and MFU: the router and {m.moe_top_k} of {m.moe_experts} experts of width "
      f"{m.moe_d_ff} per token), d_model {m.d_model}, {m.n_layers} layers "
      f"({_layer_kinds(m)}), every one a "
      f"mixture of experts, {m.n_heads} q / {m.n_kv_heads} kv heads x {m.head_dim}, vocab "
      f"{m.vocab_size}, tied embeddings {m.tie_embeddings}; ZeRO-3 weight traffic of the "
      f"{(param_count(m) - expert_params(m)) / 1e9:.2f}B non-expert params "
      f"{param_traffic_s(m, hw, a):.1f} s per step, assumed hidden",
      f"    * expert parallelism: each layer's experts split over all {g} GPUs "
      f"(`parallel.expert_axes=seq`, {m.moe_experts // g} per GPU, their states never "
      f"gathered), dispatch `ragged_all_to_all`, router balanced; an expert takes at most "
      f"{m.moe_capacity_factor}x its fair share of the group's pairs, so a GPU's experts "
      f"receive into {slots / pairs:.2f}x its own pairs' rows",
      f"    * token exchange per layer and GPU: kept (token, expert) pairs x d_model x "
      f"{a.compute_bytes} B to the experts and as many back, in the forward, the remat's "
      f"forward and the backward (6 exchanges); at L = {_k(seq_len)} {rows} rows x "
      f"{m.moe_top_k} = {pairs} pairs, {one_way / GB:.2f} GB each way, "
      f"{sent / m.n_layers / GB:.2f} GB per layer, {sent / GB:.0f} GB per step "
      f"({(g - 1) / g:.0%} leaving the GPU, {max(g - hw.gpus_per_node, 0) / g:.0%} the node), "
      f"{seconds:.1f} s per step, exposed"]


def _strategy_table(rows: list[dict], spd: list[dict]) -> list[str]:
  head = ("| model | L | B | " + " | ".join(STRATEGIES)
          + " | best baseline | CSBP speedup | CSBP MFU |")
  lines = ["Step time in s / peak memory in GB per GPU (one sequence of L tokens over 16 GPUs; "
           "memory compiled by scale_probe where it ran, else assumed and marked *a*; "
           "**OOM** = over the usable HBM, excluded from *best*).", "", head,
           "|" + "---|" * (6 + len(STRATEGIES))]
  for s in spd:
    cells = []
    for name in STRATEGIES:
      r = next(r for r in rows if (r["model"], r["seq_len"], r["block_size"], r["strategy"])
               == (s["model"], s["seq_len"], s["block_size"], name))
      oom = "" if r["fits"] else " **OOM**"
      assumed = "" if r["compiled_bytes"] else " *a*"
      cells.append(f"{r['total_s']:.2f} / {r['memory_bytes'] / GB:.0f}{assumed}{oom}")
    speed = "—" if s["speedup"] is None else f"{s['speedup']:.2f}x ({s['csbp']})"
    mfu = "—" if s["csbp_mfu"] is None else f"{s['csbp_mfu']:.0%}"
    lines.append(f"| {s['model']} | {_k(s['seq_len'])} | {s['block_size']} | "
                 + " | ".join(cells) + f" | {s['baseline'] or '—'} | {speed} | {mfu} |")
  return lines + [""]


def _range(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "—"
  lo, hi = min(values), max(values)
  return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def _driver(by_scenario: dict, low: float, high: float, default: list[dict]) -> str:
  """Where the default's speedup comes from, and which single assumption moves it onto the
  paper's figure."""
  def distance(values):  # gap between the projected range and the paper's range
    return max(low - max(values), min(values) - high, 0.0) if values else float("inf")
  if not default:
    return "nothing fits in memory"
  idle = (f"{default[0]['baseline']} spends {max(s['baseline_idle'] for s in default):.0%} of "
          f"its step communicating or waiting, {default[0]['csbp']} "
          f"{max(s['csbp_idle'] for s in default):.0%}")
  if distance(by_scenario["default"]) == 0:
    return f"agrees: {idle}"
  direction = "below" if max(by_scenario["default"]) < low else "above"
  name = min(by_scenario, key=lambda n: distance(by_scenario[n]))
  if name == "default":
    return f"{direction}: {idle}; no single changed assumption comes closer"
  verdict = "reaches it" if distance(by_scenario[name]) == 0 else "comes closest"
  return f"{direction}: {idle}; '{name}' {verdict}"


def _paper_table(results: dict) -> list[str]:
  lines = ["| claim | hardware | L | model | paper | " + " | ".join(results)
           + " | what drives it |", "|" + "---|" * (6 + len(results))]
  for claim in PAPER:
    paper = (f"{claim['low']:.2f}x" if claim["low"] == claim["high"]
             else f"{claim['low']:.2f}-{claim['high']:.2f}x")
    head = f"| {claim['claim']} | {claim['hardware']} | {_k(claim['seq_len'])} |"
    if claim["hardware"] != "16x H200":
      lines.append(f"{head} — | {paper} | " + " | ".join(["not modelled"] * len(results))
                   + " | the drafter objective (anchor + MASK blocks reading target-model "
                   "context) has no layout plan here yet |")
      continue
    for model in MODELS:
      pick = lambda spd: [s for s in spd if s["seq_len"] == claim["seq_len"]
                          and s["model"] == model and s["speedup"] is not None]
      by = {name: [s["speedup"] for s in pick(spd)] for name, spd in results.items()}
      baselines = sorted({s["baseline"] for s in pick(results["default"])})
      cells = [_range(v) for v in by.values()]
      cells[0] += f" (vs {', '.join(baselines)})" if baselines else ""
      driver = _driver(by, claim["low"], claim["high"], pick(results["default"]))
      lines.append(f"{head} {model} | {paper} | " + " | ".join(cells) + f" | {driver} |")
  return lines + [""]


def _ring_table(rows: list[dict], hw: Hardware, a: Assumptions, block_size: int) -> list[str]:
  """Where ring time goes: busy attention vs wall attention, and one hop vs a mean step."""
  lines = [f"Ring transports at B={block_size}: attention compute of the busiest rank (*busy*) "
           "vs the ring's wall time (*wall*; the difference is waiting for neighbours or "
           "exposed transfers), and one forward K/V hop vs a mean forward ring step.", "",
           "| model | L | strategy | busy s | wall s | hop ms | mean step ms |",
           "|---|---|---|---|---|---|---|"]
  rings = [r for r in rows if r["block_size"] == block_size and TRANSPORT[r["strategy"]] == "ring"]
  for r in sorted(rings, key=lambda r: (list(MODELS).index(r["model"]), r["seq_len"],
                                        r["strategy"])):
    m, p = MODELS[r["model"]], hw.num_gpus
    work = plan_work(r["strategy"], r["seq_len"], block_size, p)
    hop = _hop_s(work.n_travel * 2 * m.n_kv_heads * m.head_dim * a.compute_bytes, hw, p)
    step = (work.travel_pairs.sum(axis=1).mean() / p * 4 * m.n_heads * m.head_dim
            / (hw.attention_tflops * 1e12))
    lines.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['strategy']} | "
                 f"{r['attention_busy_s']:.2f} | {r['attention_s']:.2f} | {hop * 1e3:.1f} | "
                 f"{step * 1e3:.1f} |")
  return lines + [""]


def _memory_table(rows: list[dict], hw: Hardware, probe: str) -> list[str]:
  """The assumed memory next to the compiled one, and where each verdict came from."""
  limit = hw.hbm_gb * hw.usable_fraction
  both = [r for r in rows if r["compiled_bytes"]]
  lines = [f"Fits / OOM against {limit:.0f} GB usable: {len(both)} of {len(rows)} verdicts "
           f"compiled (the real train step's per-device peak, read from `{probe}`, of an "
           f"MoE its ragged dispatch compiled with stand-ins; at the "
           f"probe's block size, and the same figure for the other block sizes), the other "
           f"{len(rows) - len(both)} assumed (this model's estimate). Below: the probed "
           "settings.", ""]
  if not both:
    return lines + ["No compiled figures: run `experiments/scale_probe.py` (16 devices, "
                    "block size 64, full depth) for compiled verdicts.", ""]
  lines += ["| model | L | B | strategy | assumed GB | compiled GB | assumed ÷ compiled | "
            "verdict |", "|---|---|---|---|---|---|---|---|"]
  for r in (r for r in both if r["compiled_here"]):
    lines.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['block_size']} | {r['strategy']} | "
                 f"{r['total_bytes'] / GB:.1f} | {r['compiled_bytes'] / GB:.1f} | "
                 f"{r['total_bytes'] / r['compiled_bytes']:.3f} | "
                 f"{'fits' if r['fits'] else 'OOM'} (compiled) |")
  return lines + [""]


def report(hw: Hardware, calibration: str, compiled=None,
           probe: str = "scale_probe.csv") -> tuple[str, list[dict]]:
  rows_by = project(hw, SCENARIOS, compiled=compiled)
  results = {name: speedups(rows) for name, rows in rows_by.items()}
  default = SCENARIOS["default"]
  lines = ["## Cost model: projected step time and memory (16 H200)", "",
           "Produced by `experiments/cost_model.py`: an analytical model, not a measurement. "
           "Work per rank comes from the strategies' real layout plans; time from achieved "
           "TFLOP/s and an alpha-beta network; memory from the compiled train step where "
           "`experiments/scale_probe.py` compiled it, else assumed from states, saved "
           "activations and the largest transient. CSBP speedup = best fitting baseline "
           "(cp_ring, cp_allgather, bp) over the best fitting CSBP transport.", ""]
  lines += _constants(hw, default, calibration)
  lines += ["### Default scenario (tile skipping, ring overlap)", ""]
  lines += _strategy_table(rows_by["default"], results["default"])
  lines += ["### Memory: assumed vs compiled", ""]
  lines += _memory_table(rows_by["default"], hw, probe)
  lines += _ring_table(rows_by["default"], hw, default, 64)
  lines += ["### Projection next to the paper", "",
            "Ranges run over each model's block sizes " + ", ".join(map(str, BLOCK_SIZES))
            + ". Scenarios change one assumption: *balanced ring steps* gives every rank its "
            "mean ring-step time (what a CP layout balanced per step, not only per rank, "
            "would get); *no ring overlap* exposes every ring hop; "
            "*no tile skipping* makes the kernel compute every pair of each K/V visit that has "
            "any allowed pair (as the `xla` kernel and mask-unaware flash kernels do). SFT and "
            "AR->BDLM conversion train the same [x_t; x_0] stream, so the plans (and this "
            "model) do not tell them apart. The block size barely moves the projection: "
            "allowed pairs are L(L+B) and every plan balances at these B; where B matters "
            "on a GPU is tile waste around B x B diagonal blocks, which this model ignores.",
            ""]
  lines += _paper_table(results)
  return "\n".join(lines), rows_by["default"]


def write_results_readme(results_dir: str) -> str:
  """README_results.md = the sections the experiment scripts wrote, in a fixed order."""
  parts = ["# Results", "",
           "Generated; do not edit. Regenerate with "
           "`python experiments/parallel_bench.py --quick && python experiments/scale_probe.py "
           "&& python experiments/scale_probe.py --models qwen3-30b-a3b --lens 262144 --append "
           "&& python experiments/scale_probe.py --ablate --models llama3-8b --lens 262144 "
           "--strategies csbp_ring csbp_allgather && python experiments/cost_model.py` "
           "(and `python experiments/window_traffic.py`, `python experiments/block_size_sweep.py` "
           "for the last sections).", ""]
  for name in ("parallel_bench.md", "scale_probe.md", "scale_probe_ablation.md",
               "cost_model.md", "window_traffic.md", "block_size_sweep.md"):
    path = os.path.join(results_dir, name)
    if os.path.exists(path):
      with open(path) as f:
        parts.append(f.read())
  text = "\n".join(parts)
  path = os.path.join(results_dir, "README_results.md")
  with open(path, "w") as f:
    f.write(text)
  if os.path.abspath(results_dir) == RESULTS_DIR:  # not for scratch runs (tests, --out)
    body = text.replace("# Results\n", "", 1)
    _splice_into_readme(body.replace("\n### ", "\n#### ").replace("\n## ", "\n### "))
  return path


RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"


def _splice_into_readme(text: str) -> None:
  """The project README shows the same generated tables between its results markers."""
  readme = os.path.join(ROOT, "README.md")
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


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=RESULTS_DIR)
  parser.add_argument("--kernel-csv", default=None,
                      help="CSV from experiments/kernel_bench.py to calibrate attention TFLOP/s")
  parser.add_argument("--probe-csv", default=os.path.join(RESULTS_DIR, "scale_probe.csv"),
                      help="compiled memory from experiments/scale_probe.py (used if present)")
  args = parser.parse_args(argv)
  hw, calibration = calibrate(Hardware(), args.kernel_csv)
  compiled = load_probe(args.probe_csv, hw) if os.path.exists(args.probe_csv) else {}
  text, rows = report(hw, calibration, compiled, os.path.relpath(args.probe_csv, ROOT))
  print(text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "cost_model.md"), "w") as f:
    f.write(text)
  with open(os.path.join(args.out, "cost_model.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  write_results_readme(args.out)


if __name__ == "__main__":
  main()
