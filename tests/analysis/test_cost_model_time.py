"""Where the cost model says the time goes: remat=offload's host copies (their bytes against
what the remat policy really puts in host memory, hand-worked; whether they hide under their
layers) and the strong-scaling sweep (more GPUs, less compute each; a hop that leaves the
node is slower)."""

import csv
import dataclasses

import jax
import numpy as np
import pytest
from jax._src import core
from jax._src.ad_checkpoint import saved_residuals

from bdlm_jax import init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.analysis.cost_model import report, setting, timing
from bdlm_jax.analysis.cost_model.memory import peak_memory, saved_layer_bytes
from bdlm_jax.analysis.cost_model.projection import offload_rows, scaling_rows
from bdlm_jax.analysis.cost_model.work import plan_work, step_comm_bytes
from bdlm_jax.analysis.plan_mode import mesh_hardware
from bdlm_jax.analysis.step_report import META_ROW_BYTES
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.metrics import linear_flops_per_row
from bdlm_jax.parallel.strategies import exchange_for
from experiments import cost_model

L, B, D, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 32, 4, 2, 8
F32 = setting.Assumptions(compute_bytes=4)  # the test model computes in float32


def _cfg(strategy="none", seq=1, **layers):
  return replace(Config(), model=dict(vocab_size=260, d_model=D, n_layers=2, n_heads=HEADS,
                                      n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, d_ff=64,
                                      remat="offload", **layers),
                 data=dict(seq_len=L), objective=dict(block_size=B),
                 parallel=dict(strategy=strategy, seq=seq), train=dict(batch_size=1))


def _host_residuals(cfg):
  """Shapes of the residuals the traced train step keeps in host memory."""
  mesh = make_mesh(cfg) if cfg.parallel.seq > 1 else None
  params = init_params(cfg, jax.random.key(0), mesh)
  batch = make_batch(cfg, np.random.default_rng(0).integers(0, 250, (1, L)))
  saved = saved_residuals(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0], params)
  return [a for a, _ in saved if a.memory_space == core.MemorySpace.Host]


@pytest.mark.parametrize("strategy,ranks", [("none", 1), ("csbp_ring", 4)])
def test_host_bytes_per_layer_are_what_remat_offload_puts_in_host_memory(strategy, ranks):
  """Hand-worked, per rank and layer: 2L/P rows x (the layer input's D floats and its 6
  int32 position and row-metadata fields, the attention output's H x hd floats, its H f32
  LSE); each goes to the host in the forward and comes back in the backward."""
  rows = 2 * L // ranks
  hand = rows * ((D + HEADS * HEAD_DIM) * 4 + 6 * 4 + HEADS * 4)  # 1 rank: 128 x 296 B
  cfg = _cfg(strategy, ranks)
  work = plan_work(strategy, L, B, ranks)
  assert saved_layer_bytes(cfg.model, work, None, F32) == hand
  host = sum(a.size * a.dtype.itemsize for a in _host_residuals(cfg))
  assert host / ranks == cfg.model.n_layers * hand
  hw = setting.Hardware(nodes=1, gpus_per_node=ranks)
  t = timing.step_time(cfg.model, work, hw, F32)
  assert t["host_bytes_per_step"] == 2 * cfg.model.n_layers * hand
  assert peak_memory(cfg.model, work, hw, F32)["host_bytes"] == cfg.model.n_layers * hand


def test_a_local_layer_also_offloads_the_kv_rows_its_window_received():
  """csbp_ring on 4 ranks, window 8: each rank receives 2 x 7 K/V rows (2 kv heads x 8, K
  and V in float32) with their 4 int32 key-metadata fields, and keeps them in host memory."""
  cfg = _cfg("csbp_ring", 4, layer_pattern="local,global", sliding_window=8)
  work = plan_work("csbp_ring", L, B, 4)
  received = exchange_for(work.plan, 8).rows_sent()
  hand = received * (2 * KV_HEADS * HEAD_DIM * 4 + META_ROW_BYTES)
  assert (received, hand) == (14, 14 * 144)
  m = cfg.model
  assert saved_layer_bytes(m, work, 8, F32) - saved_layer_bytes(m, work, None, F32) == hand
  rows = work.plan.rows_per_rank
  exchanged = [a for a in _host_residuals(cfg) if a.ndim >= 3 and a.shape[1] == 4
               and a.shape[2] != rows]  # [layers, ranks, received rows, ...]
  assert sum(a.size * a.dtype.itemsize for a in exchanged) / 4 == hand


SMALL = replace(Config(), model=dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4,
                                     n_kv_heads=2, head_dim=16, d_ff=128)).model


def test_a_copy_hides_under_its_layer_and_only_its_excess_shows():
  """1 GB per layer at 50 GB/s is 20 ms each way: under a 30 ms backward it hides, past a
  10 ms forward 10 ms of it shows, twice over two such layers."""
  hw = dataclasses.replace(setting.Hardware(), host_gb_s=50.0)
  nbytes, copying, exposed = timing.host_transfer([(2, 1e9, 0.010, 0.030)], hw)
  assert nbytes == 4e9
  assert copying == pytest.approx(0.08) and exposed == pytest.approx(0.02)


def test_offload_adds_only_the_exposed_copies_to_the_step():
  """At a fast link offload costs remat=full's step; at a crawl the copies stop hiding and
  exactly what shows adds to it. Device memory keeps two layers' residuals, the host the
  rest."""
  work = plan_work("csbp_ring", 512, 16, 4)
  full = dataclasses.replace(SMALL, n_layers=4)
  offload = dataclasses.replace(full, remat="offload")
  a = setting.Assumptions()
  for host_gb_s, hides in ((55.0, True), (1e-4, False)):
    hw = dataclasses.replace(setting.Hardware(nodes=1, gpus_per_node=4), host_gb_s=host_gb_s)
    t_full, t_off = (timing.step_time(m, work, hw, a) for m in (full, offload))
    assert t_full["host_exposed_s"] == 0 and t_full["host_bytes_per_step"] == 0
    assert (t_off["host_exposed_s"] == 0) == hides
    assert t_off["total_s"] == pytest.approx(t_full["total_s"] + t_off["host_exposed_s"])
  m_full, m_off = (peak_memory(m, work, hw, a) for m in (full, offload))
  layer = saved_layer_bytes(full, work, None, a)
  assert m_off["host_bytes"] == m_full["saved_bytes"] == 4 * layer
  assert m_off["saved_bytes"] == 2 * layer
  assert m_full["total_bytes"] - m_off["total_bytes"] == pytest.approx(2 * layer)


def test_offload_rows_say_whether_offload_stays_within_5_percent():
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  slow = dataclasses.replace(hw, host_gb_s=1e-4)
  models = {"small": SMALL}
  fast, crawl = (offload_rows(h, models, (4096,), 16, ("csbp_ring",))[0] for h in (hw, slow))
  assert fast["full_fits"] and fast["within_tolerance"] and fast["slowdown"] == 1.0
  assert crawl["slowdown"] > 1.05 and crawl["within_tolerance"] is False
  # offload_input: less in host memory, a slower step (the attention forward twice)
  assert fast["input_host_bytes"] < 0.7 * fast["host_bytes"]
  assert fast["input_s"] > fast["offload_s"]
  text = "\n".join(report._offload_section(hw, [fast, dict(crawl, host_gb_s=450.0)]))
  assert "| small | 4K | csbp_ring |" in text and "(within 5%)" in text
  assert f"| {fast['input_s']:.2f} / " in text


def test_more_gpus_compute_less_each_and_a_hop_leaving_the_node_is_slower():
  """8, 16, 32 GPUs in nodes of 8: the busiest rank's compute falls with every doubling
  (about halves, for the strategies that split both streams); one ring hop on InfiniBand
  (16 GPUs) takes longer than on NVLink (8)."""
  hws = [mesh_hardware(g) for g in (8, 16, 32)]
  assert [(h.nodes, h.gpus_per_node) for h in hws] == [(1, 8), (2, 8), (4, 8)]
  rows = scaling_rows(hws, {"small": SMALL}, (4096,), 16, ("cp_ring", "csbp_ring"))
  for name in ("cp_ring", "csbp_ring"):
    compute = [r["compute_s"] for r in rows if r["strategy"] == name]
    assert len(compute) == 3
    for fewer, more in zip(compute, compute[1:]):
      assert 0.45 * fewer < more < 0.6 * fewer
  hop = lambda hw: timing.hop_s(1e8, hw, hw.num_gpus)
  assert hop(hws[1]) > 5 * hop(hws[0])  # 45 GB/s InfiniBand against 360 GB/s NVLink
  assert hop(hws[2]) == hop(hws[1])


def test_scaling_flag_writes_its_table_csv_and_plot(tmp_path):
  cost_model.write_scaling(setting.Hardware(), "attention TFLOP/s: assumed", str(tmp_path),
                           gpus=(8, 16), models={"small": SMALL}, seq_lens=(4096,),
                           block_size=16, strategies=("cp_ring", "csbp_ring"))
  with open(tmp_path / "cost_model_scaling.csv") as f:
    got = list(csv.DictReader(f))
  assert sorted((int(r["gpus"]), r["strategy"]) for r in got) == [
      (8, "cp_ring"), (8, "csbp_ring"), (16, "cp_ring"), (16, "csbp_ring")]
  text = (tmp_path / "cost_model_scaling.md").read_text()
  assert "| small | 4K | 16 |" in text and "* small at 4K: 8: " in text
  assert (tmp_path / "cost_model_scaling.png").stat().st_size > 0
  assert "strong scaling" in (tmp_path / "projections.md").read_text()


def test_offload_input_keeps_the_layer_input_alone_and_reruns_the_attention_forward():
  """remat=offload_input, csbp_ring on 4 ranks: host memory holds each layer's input with its
  6 int32 fields alone (hand-worked, and what the traced step offloads); with a local and a
  global layer, the backward's re-run adds each layer's attention forward to the time and
  one forward's K/V + metadata to the traffic."""
  work = plan_work("csbp_ring", L, B, 4)
  hand = work.plan.rows_per_rank * (D * 4 + 6 * 4)
  cfg = replace(_cfg("csbp_ring", 4), model=dict(remat="offload_input"))
  assert saved_layer_bytes(cfg.model, work, None, F32) == hand
  assert sum(a.size * a.dtype.itemsize for a in _host_residuals(cfg)) / 4 == 2 * hand
  m = replace(cfg, model=dict(layer_pattern="local,global", sliding_window=8)).model
  assert saved_layer_bytes(m, work, 8, F32) == hand
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  offload = dataclasses.replace(m, remat="offload")
  rerun = (timing.attention_s(m, work, *work.executed(F32.tile_skipping), hw, F32)[0]
           + timing.local_attention_s(m, work, 8, hw, F32)[0])
  np.testing.assert_allclose(timing.step_time(m, work, hw, F32)["attention_s"],
                             timing.step_time(offload, work, hw, F32)["attention_s"] + rerun)
  row = 2 * KV_HEADS * HEAD_DIM * 4 + F32.meta_bytes_per_row  # K and V in f32, metadata
  ring = 3 * work.n_travel * row  # the global layer's forward ring: P - 1 hops
  window = exchange_for(work.plan, 8).rows_sent() * row  # the local layer's exchange
  np.testing.assert_allclose(step_comm_bytes(work, m, F32),
                             step_comm_bytes(work, offload, F32) + ring + window)


def test_offload_input_reruns_an_all_gathers_compute_but_not_its_gather():
  """csbp_allgather on 4 ranks: the backward's re-run gathers nothing beyond the backward's
  own re-gather (XLA merges the two: tests/analysis/test_step_report.py), so the traffic is
  remat=offload's and the time adds the attention's compute alone, not its exposed gather."""
  work = plan_work("csbp_allgather", L, B, 4)
  m = replace(_cfg("csbp_allgather", 4), model=dict(remat="offload_input")).model
  offload = dataclasses.replace(m, remat="offload")
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  fwd, _, busy = timing.attention_s(m, work, *work.executed(F32.tile_skipping), hw, F32)
  assert fwd > busy  # the forward waits for its gather
  np.testing.assert_allclose(timing.step_time(m, work, hw, F32)["attention_s"],
                             timing.step_time(offload, work, hw, F32)["attention_s"]
                             + m.n_layers * busy)
  assert step_comm_bytes(work, m, F32) == step_comm_bytes(work, offload, F32)


def test_offload_period_keeps_a_steps_input_and_reruns_the_linear_layers_once_more():
  """remat=offload_period, 2 layers a scan step: host memory holds half of offload_input's
  (one layer input a step), the device a step's `full` saves while it runs backward, and the
  backward runs each layer's linear forward once more than offload_input's."""
  work = plan_work("csbp_ring", L, B, 4)
  m = dataclasses.replace(_cfg("csbp_ring", 4).model, n_layers=4, remat="offload_input")
  period = dataclasses.replace(m, remat="offload_period", scan_period=2)
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  inputs, steps = (peak_memory(x, work, hw, F32) for x in (m, period))
  assert steps["host_bytes"] == inputs["host_bytes"] / 2
  full = saved_layer_bytes(dataclasses.replace(m, remat="full"), work, None, F32)
  assert steps["saved_bytes"] == 2 * full
  t_in, t_step = (timing.step_time(x, work, hw, F32) for x in (m, period))
  linear = work.plan.rows_per_rank * linear_flops_per_row(m) / (hw.matmul_tflops * 1e12)
  assert t_step["attention_s"] == t_in["attention_s"]
  assert t_step["linear_s"] - t_in["linear_s"] == pytest.approx(linear)


def test_offload_period_host_bytes_of_a_hybrid_are_what_remat_puts_in_host_memory():
  """Gated DeltaNet and global layers, 2 a scan step: each step's input (D floats and its row
  metadata) goes to the host once, for both its layers, out in the forward and back in the
  backward; the cost model counts the same bytes for either layer kind."""
  cfg = replace(_cfg(), model=dict(n_layers=4, layer_pattern="gdn,global",
                                   remat="offload_period"))
  host = sum(a.size * a.dtype.itemsize for a in _host_residuals(cfg))
  assert host == 2 * 2 * L * (D * 4 + 6 * 4)  # 2 scan steps x 2L rows x (input, 6 int32)
  work, hw = plan_work("none", L, B, 1), setting.Hardware(nodes=1, gpus_per_node=1)
  assert timing.step_time(cfg.model, work, hw, F32)["host_bytes_per_step"] == 2 * host
