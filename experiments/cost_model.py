"""Analytical step time and peak memory per sequence strategy, projected to the paper's
settings (16 H200 = 2 nodes x 8, 8B- and 27B-class dense models and a 30B-A3B-class
mixture of experts, 128K-1M tokens), and DFlash drafter training on 8 H100 (one node).

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

* DFlash drafter training (`dflash_project`, DESIGN.md section 10): a Qwen3-8B target,
  frozen, runs a causal forward over the L context rows; a 5-layer drafter trains over A
  draft blocks. The drafter's work comes from its real plans (`make_plan(...,
  draft_blocks=A)`, `draft_work`), the target's from the context zigzag its rows sit on
  (`context_work`: context parallel under cp_* and csbp_*, the whole context on every GPU
  under bp); useful FLOPs equal `model_flops_per_step` of the dflash config. Its own
  constants (the target, A, 80 GB) are printed in its section.

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

from bdlm_jax.config import (Config, ModelConfig, drafter_model, layer_types,  # noqa: E402
                             mlp_types, replace, target_depth, target_layer_ids)
from bdlm_jax.models.moe import capacity  # noqa: E402
from bdlm_jax.parallel.hlo_stats import COLLECTIVE_KINDS, wire_bytes  # noqa: E402
from bdlm_jax.parallel.layout import PAD, LayoutPlan, make_plan  # noqa: E402
from bdlm_jax.parallel.step_report import attention_traffic  # noqa: E402
from bdlm_jax.parallel.strategies import TRANSPORTS, exchange_for, window_transport  # noqa: E402

STRATEGIES = ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp", "csbp_allgather", "csbp_ring")
BASELINES = ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp")
TRANSPORT = dict(TRANSPORTS)  # every strategy's, `none` too (the dflash projection's)
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
  return _work_of(make_plan(strategy, seq_len, block_size, num_ranks))


def _work_of(plan: LayoutPlan) -> PlanWork:
  """`PlanWork` of a [x_t ; x_0] plan, or of an autoregressive one (clean stream only)."""
  seq_len, block_size = plan.seq_len, plan.block_size
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


# ----------------------------------------------------------------------------- dflash

# DFlash drafter training (DESIGN.md section 10) on one node of 8 H100: Qwen3-8B as the frozen
# target, DFlash's Qwen3-8B drafter (5 layers of the target's width and heads, d_ff 12288,
# blocks of 16; its context: 5 target layers' outputs -> fc -> RMSNorm).
DFLASH_TARGET = ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, d_ff=12288, rope_theta=1e6,
                            qk_norm=True, tie_embeddings=False, compute_dtype="bfloat16")
DFLASH_DRAFT_LAYERS = 5
DFLASH_BLOCK = 16
DFLASH_SEQ_LENS = (512 * 1024, 1024 * 1024)
# Anchors per sequence: SpecForge's DFlash recipe for Qwen3-8B draws 512 (at 3K tokens); the
# same 512 at 512K-1M is one anchor per 1-2K tokens. A = L/64 (a quarter of the rows drafted)
# is the sensitivity row: the drafter's own share of the step grows with A.
DFLASH_ANCHORS = (("512 (SpecForge recipe)", lambda seq_len: 512),
                  ("L/64 (sensitivity)", lambda seq_len: seq_len // 64))
# `none` here is data parallel: each GPU trains its own sequence (not a sequence strategy, so
# not a baseline of DESIGN.md section 10; shown for reference).
DFLASH_STRATEGIES = ("none", "cp_allgather", "cp_ring", "bp", "csbp_allgather", "csbp_ring")
DFLASH_BASELINES = ("cp_allgather", "cp_ring", "bp")
DFLASH_CSBP = ("csbp_allgather", "csbp_ring")


def h100(hw: Hardware) -> Hardware:
  """One node of 8 H100 SXM: the H200's compute die (same peak, same achieved GEMM and
  attention rates, a kernel calibration included) and NVLink 4, 80 GB of HBM, no InfiniBand."""
  return dataclasses.replace(
      hw, name="8x H100 SXM 80 GB (one node, NVLink 4: 900 GB/s bidirectional per GPU)",
      nodes=1, gpus_per_node=8, hbm_gb=80.0)


def dflash_config(seq_len: int, anchors: int, target: ModelConfig = DFLASH_TARGET,
                  draft_layers: int = DFLASH_DRAFT_LAYERS, block_size: int = DFLASH_BLOCK):
  """The bdlm_jax config of a dflash run: `model` the target, `drafter` its widths' defaults."""
  return replace(Config(), model=dataclasses.asdict(target), data=dict(seq_len=seq_len),
                 objective=dict(name="dflash", block_size=block_size, max_anchors=anchors),
                 drafter=dict(n_layers=draft_layers), train=dict(batch_size=1))


def drafter_params(cfg) -> int:
  """Trainable parameters: the drafter's layers, fc and its two norms (the embedding and LM
  head are the frozen target's)."""
  d = drafter_model(cfg)
  n_feat = len(target_layer_ids(cfg))
  return param_count(dataclasses.replace(d, vocab_size=0)) + n_feat * d.d_model ** 2 + d.d_model


def dflash_useful_flops(cfg) -> float:
  """Useful FLOPs of one sequence's step, as `model_flops_per_step` counts a dflash config:
  the target's causal forward over the L context rows (1x), and 3x the drafter's forward: its
  layers and logits over the A*B draft rows, fc and each layer's context k/v over the L
  context rows, the draft queries' allowed pairs (anchors at `LayoutPlan.block_starts`)."""
  m, d, seq_len = cfg.model, drafter_model(cfg), cfg.data.seq_len
  n_feat = len(target_layer_ids(cfg))
  plan = make_plan("none", seq_len, cfg.objective.block_size, 1,
                   draft_blocks=cfg.objective.max_anchors)
  depth = target_depth(cfg)  # the target layers a step runs
  target = (seq_len * depth * layer_flops_per_row(m)
            + 4.0 * seq_len * (seq_len + 1) / 2 * m.n_heads * m.head_dim * depth)
  ctx_kv = 2 * d.d_model * 2 * d.n_kv_heads * d.head_dim
  drafter = (plan.noisy_len * (d.n_layers * layer_flops_per_row(d) + 2 * d.d_model * m.vocab_size)
             + seq_len * (d.n_layers * ctx_kv + 2 * n_feat * m.d_model * d.d_model)
             + 4.0 * float(plan.attention_work().sum()) * d.n_heads * d.head_dim * d.n_layers)
  return target + 3 * drafter


def draft_work(strategy: str, seq_len: int, block_size: int, num_ranks: int,
               anchors: int) -> PlanWork:
  """The drafter's attention per rank: its draft queries (each rank's noisy slot) x the keys
  their mask allows (own block's draft rows, context before the anchor), split by whose K/V
  they read, stay or travelling (`plan.travel`). Sums to `attention_work()` per rank."""
  plan = make_plan(strategy, seq_len, block_size, num_ranks, draft_blocks=anchors)
  split = {"all": 0, "clean": plan.n_noisy, "none": plan.rows_per_rank}[plan.travel]
  n, starts = plan.noisy_len, plan.block_starts()

  def keys_A(rows):  # [A]: keys among `rows` that each draft block's queries may read
    rows = rows[rows != PAD]
    context = np.sort(rows[rows >= n] - n)
    return (np.bincount(rows[rows < n] // block_size, minlength=anchors)
            + np.searchsorted(context, starts))

  queries_PA = np.stack([np.bincount(q[q != PAD] // block_size, minlength=anchors)
                         for q in plan.rows[:, :plan.n_noisy]]).astype(np.int64)
  stay_PA = np.stack([keys_A(r[:split]) for r in plan.rows]).astype(np.int64)
  travel_PA = np.stack([keys_A(r[split:]) for r in plan.rows]).astype(np.int64)
  return PlanWork(plan, np.einsum("ra,ra->r", queries_PA, stay_PA), queries_PA @ travel_PA.T,
                  split, plan.rows_per_rank - split)


def context_work(strategy: str, seq_len: int, num_ranks: int) -> PlanWork:
  """The frozen target's causal forward over the context: context parallel on the very zigzag
  shards the drafter's context rows sit on, with the strategy's transport (every context
  row's K/V travels) under cp_* and csbp_*; over the whole context on every rank under bp
  (replicated) and on the one GPU of `none`."""
  transport = TRANSPORT[strategy]
  if transport == "local":
    return _work_of(make_plan("none", seq_len, 1, 1, noisy_stream=False))
  return _work_of(make_plan(f"cp_{transport}", seq_len, 1, num_ranks, noisy_stream=False))


def dflash_works(strategy: str, cfg, num_gpus: int) -> tuple[PlanWork, PlanWork]:
  """(drafter, target) work of one sequence: over every GPU, or one GPU under `none`."""
  p = 1 if strategy == "none" else num_gpus
  o = cfg.objective
  return (draft_work(strategy, cfg.data.seq_len, o.block_size, p, o.max_anchors),
          context_work(strategy, cfg.data.seq_len, p))


def dflash_step_time(cfg, drafter: PlanWork, target: PlanWork, hw: Hardware,
                     a: Assumptions) -> dict:
  """Seconds of one sequence's step on its GPUs, and where they go. The target runs forward
  only (no remat, no backward, its ring moves K/V one way); the drafter forward + backward
  under full remat, its context k/v projections inside each (rematerialised) layer, fc once.
  Every rank runs its context rows (L/P, or L under bp and none) through the target, fc and
  the drafter's context k/v; its draft rows through the drafter's layers and the LM head."""
  m, d = cfg.model, drafter_model(cfg)
  n_feat = len(target_layer_ids(cfg))
  matmul = hw.matmul_tflops * 1e12
  ctx_rows = drafter.plan.rows_per_rank - drafter.plan.n_noisy
  draft_rows = drafter.plan.n_noisy
  t_attn, _, t_busy = _attention_s(m, target, target.stay_pairs, target.travel_pairs, hw, a)
  depth = target_depth(cfg)  # the target layers a step runs
  t_linear = target.plan.rows_per_rank * depth * layer_flops_per_row(m) / matmul
  fwd, bwd, busy = _attention_s(d, drafter, drafter.stay_pairs, drafter.travel_pairs, hw, a)
  ctx_kv = 2 * d.d_model * 2 * d.n_kv_heads * d.head_dim
  d_linear = ((draft_rows * layer_flops_per_row(d) + ctx_rows * ctx_kv) * d.n_layers
              * (3 + a.remat_forward)
              + 3 * 2 * (ctx_rows * n_feat * m.d_model * d.d_model
                         + draft_rows * d.d_model * m.vocab_size)) / matmul
  parts = dict(target_linear_s=t_linear, target_attention_s=depth * t_attn,
               target_attention_busy_s=depth * t_busy, drafter_linear_s=d_linear,
               drafter_attention_s=d.n_layers * (fwd + bwd),
               drafter_attention_busy_s=d.n_layers * (1 + a.attention_bwd_factor) * busy)
  total = t_linear + parts["target_attention_s"] + d_linear + parts["drafter_attention_s"]
  return dict(total_s=total, **parts, comm_bytes_per_step=dflash_comm_bytes(cfg, drafter,
                                                                            target, a))


def dflash_comm_bytes(cfg, drafter: PlanWork, target: PlanWork, a: Assumptions) -> float:
  """Bytes a GPU sends for attention in one step: the target's context K/V + metadata, P-1
  times, forward only (ring shifts or the all-gather); the drafter's travelling K/V as its
  transport moves them forward and backward (`attention_traffic`: draft and context rows
  under cp_*, context rows under csbp_*, nothing under bp)."""
  m, d = cfg.model, drafter_model(cfg)
  p = target.plan.num_ranks
  target_kv = target.n_travel * (2 * m.n_kv_heads * m.head_dim * a.compute_bytes
                                 + a.meta_bytes_per_row)
  kv_row = 2 * d.n_kv_heads * d.head_dim
  traffic = attention_traffic(drafter.plan, kv_row * a.compute_bytes, kv_row * a.kv_grad_bytes,
                              a.meta_bytes_per_row, d.n_layers)
  return (target_depth(cfg) * (p - 1) * target_kv
          + wire_bytes(traffic, drafter.plan.num_ranks))


def dflash_memory(cfg, drafter: PlanWork, target: PlanWork, hw: Hardware,
                  a: Assumptions) -> dict:
  """Bytes per GPU, assumed. States: the frozen target's bf16 weights and the drafter's
  params, grads and Adam moments, ZeRO-3 over every GPU (`none` too: 8 data-parallel GPUs).
  Held through the step: the target's features at the chosen layers ([ctx rows, n + 1, D]:
  `Transformer.features` keeps a spare slot), the fc + norm output and its f32 gradient, the
  drafter's saved layer inputs and attention outputs (full remat). The largest transient:
  one target layer's forward (two gathered layers' weights, its projections and MLP over the
  context rows, the K/V its transport holds), one drafter layer's backward (its context K/V
  recomputed with f32 grads, the travelling K/V buffers, the draft rows' linear layers), or
  one loss chunk."""
  m, d, e = cfg.model, drafter_model(cfg), a.compute_bytes
  n_feat = len(target_layer_ids(cfg))
  g = hw.num_gpus
  ctx, q = drafter.plan.rows_per_rank - drafter.plan.n_noisy, drafter.plan.n_noisy
  states = param_count(m) * e / g + drafter_params(cfg) * a.state_bytes_per_param / g
  target_layer = (param_count(m) - m.vocab_size * m.d_model * 2 - m.d_model) / m.n_layers
  held = (ctx * (n_feat + 1) * m.d_model * e + ctx * d.d_model * (e + 4)
          + d.n_layers * q * ((d.d_model + d.n_heads * d.head_dim) * e + 4 * d.n_heads))
  kv_t, kv_d = 2 * m.n_kv_heads * m.head_dim, 2 * d.n_kv_heads * d.head_dim
  t_transport = TRANSPORT[target.plan.strategy]
  t_kv = {"local": 0, "ring": 2 * target.n_travel * kv_t * e,
          "allgather": target.plan.num_ranks * target.n_travel * kv_t * e}[t_transport]
  target_tmp = (2 * target_layer * e + t_kv + ctx * (3 * m.d_model + m.n_heads * m.head_dim
                                                     + kv_t + 3 * m.d_ff) * e)
  d_transport = TRANSPORT[drafter.plan.strategy]
  d_kv = {"local": 0, "ring": 2 * drafter.n_travel * kv_d * (e + a.kv_grad_bytes),
          "allgather": (drafter.n_stay + drafter.plan.num_ranks * drafter.n_travel) * kv_d
          * (e + 4)}[d_transport]
  q_row = d.n_heads * d.head_dim
  d_linear = 2 * (q * 3 * d.d_ff + q * (d.d_model + q_row + kv_d // 2)) * e + q * q_row * 4
  drafter_tmp = ctx * kv_d * (e + 4) + d_kv + d_linear
  logits_tmp = 2 * min(m.logits_chunk or q, q) * m.vocab_size * 4
  transient = max(target_tmp, drafter_tmp, logits_tmp)
  return dict(total_bytes=states + held + transient, states_bytes=states, held_bytes=held,
              transient_bytes=transient, target_tmp_bytes=target_tmp,
              drafter_tmp_bytes=drafter_tmp)


def dflash_project(hw: Hardware, a: Assumptions, seq_lens=DFLASH_SEQ_LENS,
                   anchors=DFLASH_ANCHORS, strategies=DFLASH_STRATEGIES,
                   target: ModelConfig = DFLASH_TARGET,
                   draft_layers: int = DFLASH_DRAFT_LAYERS) -> list[dict]:
  """One row per (L, anchor rule, strategy) on `hw` (8 GPUs). `seq_s` is the time per
  sequence: the step time of one sequence over all GPUs, or under `none` (one sequence per
  GPU, data parallel) a GPU's step time / the GPU count."""
  rows = []
  for seq_len in seq_lens:
    for anchor_rule, count in anchors:
      cfg = dflash_config(seq_len, count(seq_len), target, draft_layers)
      useful = dflash_useful_flops(cfg)
      for s in strategies:
        drafter, target_work = dflash_works(s, cfg, hw.num_gpus)
        row = dict(seq_len=seq_len, anchors=count(seq_len), anchor_rule=anchor_rule,
                   strategy=s, **dflash_step_time(cfg, drafter, target_work, hw, a),
                   **dflash_memory(cfg, drafter, target_work, hw, a))
        row["seq_s"] = row["total_s"] / (hw.num_gpus if s == "none" else 1)
        row["fits"] = row["total_bytes"] <= hw.hbm_gb * GB * hw.usable_fraction
        row["mfu"] = useful / (row["seq_s"] * hw.num_gpus * hw.peak_tflops * 1e12)
        row["dominant"] = _dominant(row)
        rows.append(row)
  return rows


def _dominant(row: dict) -> str:
  """The largest part of a dflash step (waiting for the ring or exposed transfers apart)."""
  parts = {"target linear": row["target_linear_s"],
           "target attention": row["target_attention_busy_s"],
           "target K/V transfer/wait": row["target_attention_s"] - row["target_attention_busy_s"],
           "drafter linear": row["drafter_linear_s"],
           "drafter attention": row["drafter_attention_busy_s"],
           "drafter K/V transfer/wait": (row["drafter_attention_s"]
                                         - row["drafter_attention_busy_s"])}
  name = max(parts, key=parts.get)
  return f"{name} {parts[name] / row['total_s']:.0%}"


def dflash_speedups(rows: list[dict]) -> list[dict]:
  """Per (L, anchor rule): best fitting CSBP over the best fitting baseline (cp_*, bp), and
  over every baseline with memory ignored."""
  out = []
  for key in dict.fromkeys((r["seq_len"], r["anchor_rule"]) for r in rows):
    group = {r["strategy"]: r for r in rows if (r["seq_len"], r["anchor_rule"]) == key}
    best = lambda names, fit=True: min((group[s] for s in names if s in group
                                        and (group[s]["fits"] or not fit)),
                                       key=lambda r: r["seq_s"], default=None)
    base, csbp, csbp_any = best(DFLASH_BASELINES), best(DFLASH_CSBP), best(DFLASH_CSBP, False)
    out.append(dict(seq_len=key[0], anchor_rule=key[1], anchors=csbp_any["anchors"],
                    baseline=base and base["strategy"], csbp=csbp and csbp["strategy"],
                    speedup=base["seq_s"] / csbp["seq_s"] if base and csbp else None,
                    over_any={s: group[s]["seq_s"] / csbp_any["seq_s"]
                              for s in DFLASH_BASELINES + ("none",) if s in group},
                    drafter_only={s: _drafter_s(group[s]) / _drafter_s(csbp_any)
                                  for s in DFLASH_BASELINES if s in group},
                    target_share=1 - _drafter_s(csbp_any) / csbp_any["total_s"]))
  return out


def _drafter_s(row: dict) -> float:
  """The drafter's part of a step: what it would take were the target's features given."""
  return row["drafter_linear_s"] + row["drafter_attention_s"]


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


def _paper_table(results: dict, dflash_spd: list[dict] | None = None) -> list[str]:
  lines = ["| claim | hardware | L | model | paper | " + " | ".join(results)
           + " | what drives it |", "|" + "---|" * (6 + len(results))]
  for claim in PAPER:
    paper = (f"{claim['low']:.2f}x" if claim["low"] == claim["high"]
             else f"{claim['low']:.2f}-{claim['high']:.2f}x")
    head = f"| {claim['claim']} | {claim['hardware']} | {_k(claim['seq_len'])} |"
    if claim["hardware"] != "16x H200":
      at = [s for s in dflash_spd or () if s["seq_len"] == claim["seq_len"]]
      if not at:
        lines.append(f"{head} — | {paper} | " + " | ".join(["not modelled"] * len(results))
                     + " | |")
        continue
      s = at[0]  # the first anchor rule: A = 512
      cells = [f"{_x(s['speedup'])} (vs {s['baseline']}, A = {s['anchors']})"]
      lines.append(f"{head} Qwen3-8B target | {paper} | " + " | ".join(
          cells + ["not run"] * (len(results) - 1))
          + f" | below: the target's forward, {s['target_share']:.0%} of the step, runs "
          f"context-parallel under CP too; CSBP over bp {_x(s['over_any']['bp'])} (memory "
          f"ignored); see the DFlash section |")
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


def _dflash_paper(spd: list[dict]) -> dict:
  """{L: (paper's figure, this model's rows at that L)} for the DFlash claims."""
  return {c["seq_len"]: (c["low"], [s for s in spd if s["seq_len"] == c["seq_len"]])
          for c in PAPER if c["hardware"] == "8x H100"}


def _x(value) -> str:
  return "—" if value is None else f"{value:.2f}x"


def _dflash_section(hw: Hardware, a: Assumptions, rows: list[dict], spd: list[dict]) -> list[str]:
  """The drafter-training projection: its assumptions, a row per strategy, the paper's claims."""
  cfg = dflash_config(DFLASH_SEQ_LENS[0], 512)
  m, d = cfg.model, drafter_model(cfg)
  g, e = hw.num_gpus, a.compute_bytes
  ids = target_layer_ids(cfg)
  n_draft = drafter_params(cfg)
  zero3 = (param_count(m) * e + n_draft * (2 * e + 4)) * (g - 1) / g / (hw.nvlink_gb_s * GB)
  lines = [
      f"### DFlash drafter training ({hw.num_gpus}x H100, one node)", "",
      "One sequence of L tokens per step over the 8 GPUs (DESIGN.md section 10): the frozen "
      "target runs a causal forward over the L context rows (no backward) and hands 5 of its "
      "layers' outputs to the drafter, which trains forward + backward over A draft blocks of "
      "B rows. Work per GPU from the real drafter plans (`make_plan(..., draft_blocks=A)`), "
      "the target's from the context zigzag its rows already sit on; time and transports as "
      "above (ring hops hidden under each step's compute, all-gathers exposed). Assumptions:",
      "",
      f"* hardware: {hw.name}; peak {hw.peak_tflops} TFLOP/s bf16, GEMMs at "
      f"{hw.matmul_tflops}, attention at {hw.attention_tflops:.1f} (the H200's rates: same "
      f"GH100 compute), NVLink {hw.nvlink_gb_s} GB/s one way per GPU + {hw.nvlink_alpha_us} us "
      f"per hop, {hw.hbm_gb:.0f} GB HBM of which {hw.usable_fraction:.0%} usable "
      f"({hw.hbm_gb * hw.usable_fraction:.0f} GB)",
      f"* target (frozen): Qwen3-8B, {param_count(m) / 1e9:.2f}B params, {m.n_layers} layers, "
      f"d_model {m.d_model}, {m.n_heads} q / {m.n_kv_heads} kv heads x {m.head_dim}, d_ff "
      f"{m.d_ff}, vocab {m.vocab_size}; bf16 weights ZeRO-3 over the {g} GPUs "
      f"({param_count(m) * e / g / GB:.1f} GB each, two layers gathered at a time), no grads, "
      f"no optimiser state; forward only over its first {target_depth(cfg)} layers (up to the "
      f"last chosen one), nothing saved but the outputs of layers {ids} "
      f"([context rows, {len(ids) + 1}, {m.d_model}] bf16: `Transformer.features` keeps a spare "
      f"slot); a layer's projections and MLP run over all of a GPU's context rows at once "
      f"(no row chunking); its causal attention is timed at the fwd+bwd attention rate (a "
      f"forward alone runs faster: this overstates the target's seconds, alike for every "
      f"strategy)",
      f"* drafter (trained): {d.n_layers} layers of the target's width and heads, d_ff {d.d_ff}, "
      f"B = {DFLASH_BLOCK}; fc {len(ids) * m.d_model} -> {d.d_model} + RMSNorm over the context "
      f"rows, then each layer's own k/v projections of them; {n_draft / 1e9:.2f}B params with "
      f"f32 grads and Adam moments ({a.state_bytes_per_param} B/param), ZeRO-3 over the {g} "
      f"GPUs ({n_draft * a.state_bytes_per_param / g / GB:.1f} GB each); full remat (each "
      f"layer's linear forward, context k/v included, runs again in the backward); logits of "
      f"the draft rows only, through the target's frozen LM head in chunks of "
      f"{m.logits_chunk} rows",
      "* anchors A per sequence: 512, as SpecForge's DFlash recipe for Qwen3-8B draws per "
      "(3K-token) sequence; at 512K-1M that is one anchor per 1-2K tokens, and the drafter's "
      "share of the step is small. A = L/64 (a quarter of the rows drafted) shows how the "
      "projection moves with A. Anchor j sits at its expected place (j+1)L/(A+1) "
      "(`LayoutPlan.block_starts`), blocks balanced as the plans place them",
      "* what moves per GPU: cp_* the target's context K/V (forward only) and, per drafter "
      "layer, the draft + context K/V forward and their f32 dK/dV back; csbp_* the same "
      "target traffic and only the context K/V (and grads) of the drafter; bp nothing (every "
      "GPU runs the target over the whole context: P-fold compute, O(L) memory); ring "
      "overlap, tile skipping, K/V metadata as in the default scenario",
      f"* ZeRO-3 weight traffic per step (target gathered once in bf16, drafter gathered "
      f"twice, its grads reduce-scattered in f32): {zero3:.2f} s on NVLink, assumed hidden",
      f"* `none` = data parallel, one whole sequence per GPU: its time per sequence is one "
      f"GPU's step / {g}; a reference, not one of the baselines (cp_*, bp)",
      "",
      f"Time per sequence in s ({g} GPUs), its speedup over the best fitting baseline, assumed "
      "peak memory per GPU (**OOM** over the usable HBM, excluded from *best*), the target's "
      "and the drafter's seconds of one step (under `none`, a GPU's step over its own "
      "sequence), attention bytes each GPU sends per step, the largest part of the step "
      "(*transfer/wait*: exposed transfers and waiting for ring neighbours), MFU.",
      "",
      "| L | A | strategy | s / sequence | vs best baseline | GB / GPU | target s | drafter s | "
      "sent GB | dominant cost | MFU |", "|" + "---|" * 11]
  best = {(s["seq_len"], s["anchor_rule"]): s for s in spd}
  for r in rows:
    s = best[(r["seq_len"], r["anchor_rule"])]
    base = next((x for x in rows if (x["seq_len"], x["anchor_rule"], x["strategy"])
                 == (r["seq_len"], r["anchor_rule"], s["baseline"])), None)
    vs = _x(base["seq_s"] / r["seq_s"]) if base and r["fits"] else "—"
    oom = "" if r["fits"] else " **OOM**"
    target_s = r["target_linear_s"] + r["target_attention_s"]
    lines.append(f"| {_k(r['seq_len'])} | {r['anchors']} | {r['strategy']} | {r['seq_s']:.2f} | "
                 f"{vs} | {r['total_bytes'] / GB:.0f}{oom} | {target_s:.2f} | "
                 f"{_drafter_s(r):.2f} | {r['comm_bytes_per_step'] / GB:.0f} | {r['dominant']} | "
                 f"{r['mfu']:.0%} |")
  lines += ["", "CSBP over each baseline, also where it does not fit (memory ignored), and over "
            "the drafter's part alone (were the target's features given, e.g. precomputed):", "",
            "| L | A | best fitting baseline | CSBP speedup | over " + " / ".join(DFLASH_BASELINES)
            + " / none, memory ignored | drafter part only, over " + " / ".join(DFLASH_BASELINES)
            + " | target share of CSBP's step |", "|---|---|---|---|---|---|---|"]
  for s in spd:
    lines.append(f"| {_k(s['seq_len'])} | {s['anchors']} | {s['baseline'] or '—'} | "
                 f"{_x(s['speedup'])} ({s['csbp'] or '—'}) | "
                 + " / ".join(_x(v) for v in s["over_any"].values()) + " | "
                 + " / ".join(_x(v) for v in s["drafter_only"].values())
                 + f" | {s['target_share']:.0%} |")
  lines += ["", "Next to the paper (DFlash training, CSBP over the best baseline on 8 H100):", "",
            "| L | paper | ours, A = 512 | ours, A = L/64 | CSBP over bp, memory ignored | "
            "drafter part only, over bp |", "|---|---|---|---|---|---|"]
  for seq_len, (paper, at) in _dflash_paper(spd).items():
    ours = [_x(s["speedup"]) + f" (vs {s['baseline']})" for s in at]
    lines.append(f"| {_k(seq_len)} | {paper:.2f}x | " + " | ".join(ours) + " | "
                 + ", ".join(_x(s["over_any"]["bp"]) for s in at) + " | "
                 + ", ".join(_x(s["drafter_only"]["bp"]) for s in at) + " |")
  lines += ["", _dflash_reading(spd, rows, hw), ""]
  return lines


def _dflash_reading(spd: list[dict], rows: list[dict], hw: Hardware) -> str:
  """What the projection says next to the paper's figures, and what would have to change."""
  paper = _dflash_paper(spd)
  lo, hi = min(paper), max(paper)
  by_a = lambda key, seq_len: ", ".join(f"{_x(s[key]['bp'])} at A = {s['anchors']}"
                                        for s in spd if s["seq_len"] == seq_len)
  fitting = [s["speedup"] for s in spd if s["speedup"] is not None]
  reached = any(abs(s["speedup"] - p) <= 0.1 * p for p, at in paper.values() for s in at
                if s["speedup"] is not None)
  fits = lambda name: any(r["fits"] for r in rows if r["strategy"] == name)
  bp_gb = [r["total_bytes"] / GB for r in rows if r["strategy"] == "bp"]
  return (
      f"**Reading.** Our projection {'reaches' if reached else 'does not reach'} the paper's "
      f"figures: CSBP over the best fitting baseline is {_range(fitting)}, over cp_ring "
      f"{_range([s['over_any']['cp_ring'] for s in spd])}. The frozen target's causal "
      f"forward is {min(s['target_share'] for s in spd):.0%} or more of CSBP's step, and CP "
      f"runs it context-parallel on the same zigzag shards (its K/V hops hide under each ring "
      f"step's compute); the two differ only in the drafter, where CP also moves the A*B/P "
      f"draft rows' K/V beside the L/P context rows'. bp repeats the target's O(L^2) forward "
      f"on all {hw.num_gpus} GPUs: CSBP is {_range([s['over_any']['bp'] for s in spd])} "
      f"faster, but bp needs {min(bp_gb):.0f}-{max(bp_gb):.0f} GB per GPU "
      f"({'fits' if fits('bp') else 'OOM'} on {hw.hbm_gb:.0f} GB). For the paper's figures "
      f"the best baseline would have to be bp-like (a CP baseline that does not run the "
      f"target context-parallel, and fits): the {_k(hi)} figure, {paper[hi][0]:.2f}x, is "
      f"near our CSBP over bp, memory ignored ({by_a('over_any', hi)}); the {_k(lo)} one, "
      f"{paper[lo][0]:.2f}x, is near only the drafter's part over bp ({by_a('drafter_only', lo)};"
      f" a step whose target features are given), which stays there at {_k(hi)} "
      f"({by_a('drafter_only', hi)}). No single changed assumption gives both. Data "
      f"parallelism (`none`, one sequence per GPU) would take "
      f"{_range([s['over_any']['none'] for s in spd])} CSBP's time per sequence were a whole "
      f"sequence to fit one GPU; "
      + ("it does at some of these lengths." if fits("none")
         else "it does not at these lengths."))


def report(hw: Hardware, calibration: str, compiled=None, probe: str = "scale_probe.csv",
           dflash: list[dict] | None = None) -> tuple[str, list[dict]]:
  """(markdown, the default scenario's rows). `dflash`: `dflash_project` rows on `h100(hw)`
  (projected here when not given)."""
  if dflash is None:
    dflash = dflash_project(h100(hw), SCENARIOS["default"])
  dflash_spd = dflash_speedups(dflash)
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
  lines += _paper_table(results, dflash_spd)
  lines += _dflash_section(h100(hw), default, dflash, dflash_spd)
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
               "cost_model.md", "parallel_bench_dflash.md", "scale_probe_dflash.md",
               "window_traffic.md", "block_size_sweep.md"):
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
  dflash = dflash_project(h100(hw), SCENARIOS["default"])
  text, rows = report(hw, calibration, compiled, os.path.relpath(args.probe_csv, ROOT), dflash)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "cost_model_dflash.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(dflash[0]))
    writer.writeheader()
    writer.writerows(dflash)
  with open(os.path.join(args.out, "cost_model.md"), "w") as f:
    f.write(text)
  with open(os.path.join(args.out, "cost_model.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  write_results_readme(args.out)


if __name__ == "__main__":
  main()
