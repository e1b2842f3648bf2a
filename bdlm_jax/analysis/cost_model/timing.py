"""Seconds of one step: FLOPs at achieved TFLOP/s, and an alpha-beta network.

A ring step hides its K/V hop under its compute, but each hop is a matched send/receive
between neighbours, so a rank with little work at one step waits for its neighbours: the
ring is timed step by step from each rank's work at that step. All-gather and reduce-scatter
are exposed (attention needs the gathered K/V; the backward gathers them again), as is an
MoE's token exchange (the MLP waits for its rows) and a local layer's windowed exchange.
Under `model.remat=offload` a layer's saved residuals cross the host link (`host_gb_s`) once
each way, beside the layer's own time: only what outlasts it adds to the step; under
`offload_input` its input alone does, and the backward re-runs its attention forward (a
ring's hops and an exchange's too; an all-gather's gather there is the backward's own).
"""

import dataclasses

import numpy as np

from bdlm_jax.analysis.cost_model import gdn
from bdlm_jax.analysis.cost_model.memory import layer_input_bytes, saved_layer_bytes, step_share
from bdlm_jax.analysis.cost_model.setting import GB, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.work import (PlanWork, attention_kinds, expert_params,
                                               kv_row, moe_layers, step_comm_bytes)
from bdlm_jax.analysis.step_report import layer_transport, rerun_sends
from bdlm_jax.config import ModelConfig
from bdlm_jax.metrics import linear_flops_per_row, param_count
from bdlm_jax.models.transformer import reruns_attention
from bdlm_jax.parallel.strategies import exchange_for, window_transport


def pair_s(m: ModelConfig, hw: Hardware) -> float:
  """Seconds of one (query, key) pair's forward, over every query head."""
  return 4 * m.n_heads * m.head_dim / (hw.attention_tflops * 1e12)


def hop_s(nbytes: float, hw: Hardware, num_ranks: int) -> float:
  """One ring hop, at the slowest link's pace (InfiniBand once the ring leaves a node)."""
  if num_ranks == 1:
    return 0.0  # a one-rank ring keeps everything in place
  return link_s(nbytes, hw, across_nodes=num_ranks > hw.gpus_per_node)


def link_s(nbytes: float, hw: Hardware, across_nodes: bool) -> float:
  """One message over NVLink, or InfiniBand `across_nodes`: latency + bytes at bandwidth."""
  if across_nodes:
    return hw.ib_alpha_us * 1e-6 + nbytes / (hw.ib_gb_s * GB)
  return hw.nvlink_alpha_us * 1e-6 + nbytes / (hw.nvlink_gb_s * GB)


def all_to_all_s(one_way: float, hw: Hardware) -> float:
  """One all-to-all in which each GPU sends `one_way` bytes spread evenly over every GPU (a
  1/G share staying on its GPU), exposed: its NVLink and InfiniBand shares in parallel."""
  g = hw.num_gpus
  nvlink = one_way * (min(g, hw.gpus_per_node) - 1) / g / (hw.nvlink_gb_s * GB)
  if g > hw.gpus_per_node:
    return hw.ib_alpha_us * 1e-6 + max(
        nvlink, one_way * (g - hw.gpus_per_node) / g / (hw.ib_gb_s * GB))
  return hw.nvlink_alpha_us * 1e-6 + nvlink


def ring_s(start: np.ndarray, compute: np.ndarray, kv_hop: float, grad_hop: float,
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


def ring_steps(travel: np.ndarray) -> np.ndarray:
  """[P, P]: rank r's travelling pairs at ring step s, on the K/V of rank (r - s) % P (the
  ring shifts i -> i+1)."""
  p = travel.shape[0]
  ranks = np.arange(p)
  return np.stack([travel[ranks, (ranks - s) % p] for s in range(p)], axis=1)


def moe_exchange(m: ModelConfig, rows: int, hw: Hardware, a: Assumptions) -> tuple[float, float]:
  """(bytes, seconds) per GPU and step of an MoE's token exchange, experts split over every
  GPU: per MoE layer each of the rows' k (token, expert) pairs goes to its expert's GPU
  (d_model in the compute dtype) and its output comes back; in the forward, again in the
  remat's forward, and in the backward (the gradients, the reverse way). The router is taken
  as balanced (every pair kept, a 1/G share staying on its GPU); the exchange is exposed,
  its inter-node share on InfiniBand alongside the NVLink share."""
  if not moe_layers(m) or hw.num_gpus == 1:
    return 0.0, 0.0
  one_way = rows * m.moe_top_k * m.d_model * a.compute_bytes
  exchanges = moe_layers(m) * 2 * (2 + a.remat_forward)
  return exchanges * one_way, exchanges * all_to_all_s(one_way, hw)


def attention_s(m: ModelConfig, work: PlanWork, stay: np.ndarray, travel: np.ndarray,
                hw: Hardware, a: Assumptions) -> tuple[float, float, float]:
  """(forward, backward, busiest rank's compute) seconds of one layer on the plan's own
  transport, each rank computing `stay` [P] + `travel` [P, P] (query, key) pairs."""
  p = work.plan.num_ranks
  stay_s = stay * pair_s(m, hw)
  bwd = a.attention_bwd_factor
  kv_bytes = work.n_travel * (kv_row(m) * a.compute_bytes + a.meta_bytes_per_row)
  grad_bytes = work.n_travel * kv_row(m) * a.kv_grad_bytes
  if work.transport == "ring":
    compute = ring_steps(travel) * pair_s(m, hw)
    if a.balanced_ring_steps:
      compute = np.repeat(compute.mean(axis=1, keepdims=True), p, axis=1)
    kv_hop, grad_hop = hop_s(kv_bytes, hw, p), hop_s(grad_bytes, hw, p)
    attn_fwd = ring_s(stay_s, compute, kv_hop, 0.0, a.ring_overlap)
    attn_bwd = ring_s(bwd * stay_s, bwd * compute, kv_hop, grad_hop, a.ring_overlap)
    busy = (stay_s + compute.sum(axis=1)).max()
  else:
    busy = (stay_s + travel.sum(axis=1) * pair_s(m, hw)).max()
    gather = scatter = 0.0
    if work.transport == "allgather":  # NCCL ring gather / scatter, exposed
      gather = (p - 1) * hop_s(kv_bytes, hw, p)
      scatter = (p - 1) * hop_s(grad_bytes, hw, p)
    attn_fwd, attn_bwd = busy + gather, bwd * busy + gather + scatter
  return attn_fwd, attn_bwd, busy


def local_attention_s(m: ModelConfig, work: PlanWork, window: int, hw: Hardware,
                      a: Assumptions) -> tuple[float, float, float]:
  """`attention_s` of a local layer of window W, on the transport `window_transport` picks.

  The windowed exchange: each rank computes its windowed pairs (`attention_work(W)`; without
  tile skipping its queries x [own ; received] rows), after one exposed `ppermute` per ring
  distance carrying K/V + metadata; the backward returns their dK/dV (K/V's dtype) the
  reverse way, and reuses the received rows that remat saved. On the global transport (or
  none, `bp`) with a window mask: that transport's timing with each rank's pairs scaled to
  its windowed share (the plan gives windowed pairs per rank, not per K/V owner; without
  tile skipping, the global visits' pairs, a mask-unaware kernel skipping no window)."""
  plan = work.plan
  windowed = work.windowed_pairs(window)
  if window_transport(plan, window) != "exchange":
    stay, travel = work.executed(a.tile_skipping)
    if a.tile_skipping:
      full = work.stay_pairs + work.travel_pairs.sum(axis=1)
      share = np.divide(windowed, full, out=np.zeros(len(full)), where=full > 0)
      stay, travel = stay * share, travel * share[:, None]
    return attention_s(m, work, stay, travel, hw, a)
  exchange = exchange_for(plan, window)
  rows = plan.rows_per_rank
  pairs = windowed if a.tile_skipping else rows * (rows + exchange.rows_sent())
  busy = np.max(pairs) * pair_s(m, hw)
  hops = lambda row_bytes: sum(hop_s(send.shape[1] * row_bytes, hw, plan.num_ranks)
                               for send in exchange.send)
  bwd = a.attention_bwd_factor
  return (busy + hops(kv_row(m) * a.compute_bytes + a.meta_bytes_per_row),
          bwd * busy + hops(kv_row(m) * a.compute_bytes), busy)


def chain_latency_s(m: ModelConfig, plan, hw: Hardware) -> float:
  """Seconds of one pass of the chain (2P - 1 serial steps on a zigzag): each step a
  dependent apply (`hw.chain_apply_us`) and, where the next segment is on another rank, one
  state sent over its link (NVLink inside a node, InfiniBand across)."""
  node = lambda rank: rank // hw.gpus_per_node
  hops = gdn.chain_hops(m, plan)
  return (len(hops) * hw.chain_apply_us * 1e-6
          + sum(link_s(gdn.state_bytes(m), hw, node(q) != node(r)) for q, r in hops if q != r))


def gdn_comm_s(m: ModelConfig, plan, hw: Hardware, transport: str) -> float:
  """Seconds one pass (forward, or backward) of a GDN layer waits on other devices, exposed:
  the rerun needs its entry state and conv rows, a head shard its rows. Chain: the tails'
  all-gather (P-1 ring hops), the chain, and the fetched copies (one hop); seed: its three
  all-to-alls."""
  if plan.num_ranks == 1:
    return 0.0
  if transport == gdn.ULYSSES:
    return sum(all_to_all_s(nbytes, hw) for nbytes in gdn.ulysses_bytes(m, plan))
  tails, fetched = gdn.chain_pass_bytes(m, plan)
  p = plan.num_ranks
  return ((p - 1) * hop_s(tails, hw, p) if tails else 0.0) + chain_latency_s(m, plan, hw) + (
      hop_s(fetched, hw, p) if fetched else 0.0)


def gdn_layer_s(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions,
                transport: str = gdn.CHAIN) -> tuple[float, float, float]:
  """(forward, backward, busiest rank's compute) seconds of one GDN layer beside its
  projections (timed with the linear layers): conv and delta rule at `hw.delta_rule_tflops`,
  and `gdn_comm_s`. The backward computes twice the forward (as a linear layer: an
  assumption) and waits as long; it first re-runs the forward, sends included, where remat
  does (`a.remat_forward`: parallel/recurrence.py recomputes under any remat)."""
  busy = gdn.layer_work(m, work.plan, transport).core / (hw.delta_rule_tflops * 1e12)
  fwd = busy + gdn_comm_s(m, work.plan, hw, transport)
  return fwd, fwd + busy + a.remat_forward * fwd, busy


def step_time(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions,
              gdn_transport: str = gdn.CHAIN) -> dict:
  """Seconds of one step (one sequence over the seq ranks), and where they go; each layer
  kind (global, local of window W) timed on its own transport, Gated DeltaNet layers on
  `gdn_transport` (`cost_model.gdn`); under `model.remat=offload` the host copies that do
  not hide under their layers (`host_transfer`)."""
  rows = work.plan.rows_per_rank  # padding rows run through the linear layers too
  matmul = hw.matmul_tflops * 1e12
  layer_linear = rows * linear_flops_per_row(m) / m.n_layers / matmul  # a mean layer's forward
  # Under offload_period the backward re-runs each scan step's forward before its layers'
  # own re-runs: one more forward of everything but the attention (kept by the layers).
  a = dataclasses.replace(a, remat_forward=a.remat_forward + (m.remat == "offload_period"))
  attention = busy = 0.0
  layers = []
  for window, n in attention_kinds(m):
    if window is None:
      attn_fwd, attn_bwd, layer_busy = attention_s(m, work, *work.executed(a.tile_skipping),
                                                   hw, a)
    else:
      attn_fwd, attn_bwd, layer_busy = local_attention_s(m, work, window, hw, a)
    # The backward re-runs the forward first; an all-gather's gather there is the one the
    # backward issues anyway (`rerun_sends`), so only the re-run's compute adds.
    rerun = reruns_attention(m.remat) * (
        attn_fwd if rerun_sends(layer_transport(work.plan, window)) else layer_busy)
    attention += n * (attn_fwd + attn_bwd + rerun)
    busy += n * (1 + a.attention_bwd_factor + reruns_attention(m.remat)) * layer_busy
    layers.append((n, saved_layer_bytes(m, work, window, a), layer_linear + attn_fwd,
                   (2 + a.remat_forward) * layer_linear + attn_bwd + rerun))
  n_gdn = gdn.gdn_layers(m)
  gdn_fwd, gdn_bwd, gdn_busy = (gdn_layer_s(m, work, hw, a, gdn_transport) if n_gdn
                                else (0.0, 0.0, 0.0))
  if n_gdn:
    layers.append((n_gdn, layer_input_bytes(m, work, a) * step_share(m), layer_linear + gdn_fwd,
                   (2 + a.remat_forward) * layer_linear + gdn_bwd))
  linear = m.n_layers * layer_linear * (3 + a.remat_forward)
  logits = 3 * 2 * work.plan.n_noisy * m.d_model * m.vocab_size / matmul
  moe_bytes, moe_s = moe_exchange(m, rows, hw, a)
  host_bytes, host_copy, host_exposed = (host_transfer(layers, hw)
                                         if m.remat.startswith("offload") else (0.0, 0.0, 0.0))
  return dict(total_s=linear + logits + attention + n_gdn * (gdn_fwd + gdn_bwd) + moe_s
              + host_exposed,
              attention_s=attention, linear_s=linear + logits, attention_busy_s=busy,
              comm_bytes_per_step=step_comm_bytes(work, m, a),
              gdn_s=n_gdn * (gdn_fwd + gdn_bwd),
              gdn_busy_s=n_gdn * (3 + a.remat_forward) * gdn_busy,
              gdn_comm_bytes_per_step=gdn.gdn_wire_bytes(m, work.plan, gdn_transport,
                                                         a.remat_forward),
              moe_exchange_s=moe_s, moe_exchange_bytes=moe_bytes,
              host_bytes_per_step=host_bytes, host_copy_s=host_copy,
              host_exposed_s=host_exposed)


def host_transfer(layers: list[tuple], hw: Hardware) -> tuple[float, float, float]:
  """(bytes, seconds of copying, seconds exposed) per rank and step of remat=offload's host
  copies; `layers`: (count, saved bytes, forward s, backward s) of one layer of each kind.
  A layer's saved residuals go to host memory once in the forward and come back once in the
  backward, each copy overlapping one layer's work (XLA's copy-start / copy-done: the forward
  copies a layer's residuals out while the next layer runs, the backward prefetches them
  while the layer after it runs its backward), taken here as the layer's own forward and
  backward time, as for alike layers; only what outlasts it is exposed. The host link's two
  directions are independent."""
  nbytes = copying = exposed = 0.0
  for n, saved, fwd_s, bwd_s in layers:
    copy_s = saved / (hw.host_gb_s * GB)
    nbytes += n * 2 * saved
    copying += n * 2 * copy_s
    exposed += n * (max(copy_s - fwd_s, 0.0) + max(copy_s - bwd_s, 0.0))
  return nbytes, copying, exposed


def param_traffic_s(m: ModelConfig, hw: Hardware, a: Assumptions) -> float:
  """ZeRO-3 weight traffic per step (gather bf16 twice, reduce-scatter f32 grads), the same
  for every strategy and assumed hidden under the linear layers' compute; an MoE's experts,
  split over the GPUs, do not move."""
  n = (param_count(m) - expert_params(m)) * (hw.num_gpus - 1) / hw.num_gpus
  return n * (2 * a.compute_bytes + 4) / (hw.ib_gb_s * GB)
