"""The cost model reproduces its own inputs: the plans' attention work (a local layer's
windowed pairs), the model's FLOPs and parameter count (an MoE's active ones for FLOPs, total
ones for memory), the transports' traffic per layer kind, zero traffic on one rank, and the
overlap rule of its ring."""

import csv
import dataclasses
import math

import jax
import numpy as np
import pytest

from bdlm_jax.config import Config, replace
from bdlm_jax.metrics import model_flops_per_step
from bdlm_jax.params import abstract_params
from bdlm_jax.parallel.hlo_stats import wire_bytes
from bdlm_jax.parallel.layout import make_plan
from bdlm_jax.parallel.step_report import META_ROW_BYTES, config_attention_traffic
from bdlm_jax.parallel.strategies import exchange_for, window_transport
from experiments import cost_model as cm

SMALL = dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
             d_ff=128)
MOE = dict(SMALL, moe_experts=8, moe_top_k=2, moe_d_ff=32, moe_norm_topk=True)
LOCAL = dict(SMALL, n_layers=3, layer_pattern="local,local,global", sliding_window=20)
ONE_GPU = cm.Hardware(nodes=1, gpus_per_node=1)


def _model(**kw):
  return replace(Config(), model=dict(SMALL, **kw)).model


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
@pytest.mark.parametrize("block_size", [4, 16, 24])  # N > 2P, N = 2P, P < N < 2P (P = 4)
def test_pairs_split_by_kv_owner_sum_to_attention_work(strategy, block_size):
  if strategy == "cp_ring_balanced" and 96 % (2 * 4 * block_size):
    pytest.skip("cp_ring_balanced needs L divisible by 2*P*B")
  work = cm.plan_work(strategy, 96, block_size, 4)
  per_rank = work.stay_pairs + work.travel_pairs.sum(axis=1)
  np.testing.assert_array_equal(per_rank, work.plan.attention_work())


def test_attention_pairs_are_L_times_L_plus_B():
  """Noisy and clean streams each hold B^2 N(N+1)/2 pairs, so pairs = L(L+B): doubling L
  quadruples attention FLOPs only up to the in-block term, pairs(2L) = 4 pairs(L) - 2LB."""
  pairs = lambda L, B: int(make_plan("none", L, B, 1).attention_work().sum())
  for L, B in [(64, 4), (256, 16), (1024, 256)]:
    assert pairs(L, B) == L * (L + B)
    assert pairs(2 * L, B) == 4 * pairs(L, B) - 2 * L * B


@pytest.mark.parametrize("model", [SMALL, MOE, LOCAL], ids=["dense", "moe", "local"])
def test_useful_flops_equal_model_flops_per_step(model):
  """For an MoE, both count the router and the k experts a row uses (active parameters); for
  local layers, their windowed pairs."""
  cfg = replace(Config(), model=model, data=dict(seq_len=128), objective=dict(block_size=16),
                train=dict(batch_size=1))
  assert math.isclose(cm.useful_flops(cfg.model, 128, 16), model_flops_per_step(cfg),
                      rel_tol=1e-12)


@pytest.mark.parametrize("model", [SMALL, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_equals_the_flax_model(model, tie):
  cfg = replace(Config(), model=dict(model, tie_embeddings=tie))
  real = sum(x.size for x in jax.tree.leaves(abstract_params(cfg)))
  assert cm.param_count(cfg.model) == real


def test_moe_flops_see_active_parameters_and_memory_total_ones():
  m = cm.MODELS["qwen3-30b-a3b"]
  total, active = cm.param_count(m), cm.param_count(m, active=True)
  assert 30e9 < total < 31e9 and 3.2e9 < active < 3.5e9  # Qwen3-30B-A3B: 30.5B, 3.3B
  dense = _model()
  assert cm.param_count(dense, active=True) == cm.param_count(dense)
  # Per row, a layer's FLOPs are 2x its active weights (attention core aside).
  embed = m.vocab_size * m.d_model * 2 + m.d_model
  norms = 2 * m.d_model + 2 * m.head_dim
  assert cm.layer_flops_per_row(m) == 2 * ((active - embed) / m.n_layers - norms)
  hw, a = cm.Hardware(), cm.Assumptions()
  work = cm.plan_work("csbp_ring", 16384, 64, hw.num_gpus)
  memory = cm.peak_memory(m, work, hw, a)
  assert memory["states_bytes"] == total * a.state_bytes_per_param / hw.num_gpus
  assert cm.expert_params(m) + 1.5e9 < total  # experts never travel: ZeRO-3 gathers the rest
  assert cm.param_traffic_s(m, hw, a) < cm.param_traffic_s(cm.MODELS["llama3-8b"], hw, a)


def test_moe_token_exchange_is_pairs_times_d_model_six_times_per_layer():
  m, hw, a = cm.MODELS["qwen3-30b-a3b"], cm.Hardware(), cm.Assumptions()
  rows = 2 * 262144 // hw.num_gpus
  sent, seconds = cm.moe_exchange(m, rows, hw, a)
  # there and back, in the forward, the remat's forward and the backward
  assert sent == m.n_layers * 6 * rows * m.moe_top_k * m.d_model * a.compute_bytes
  assert seconds > 0
  assert cm.moe_exchange(m, rows, ONE_GPU, a) == (0.0, 0.0)
  assert cm.moe_exchange(cm.MODELS["llama3-8b"], rows, hw, a) == (0.0, 0.0)
  pairs, slots = cm.expert_slots(m, rows, hw.num_gpus)  # receive buffers sized by capacity
  assert pairs == rows * m.moe_top_k and slots == 1.25 * pairs


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
def test_one_rank_sends_nothing_and_only_computes(strategy):
  m = _model()
  work = cm.plan_work(strategy, 256, 16, 1)
  t = cm.step_time(m, work, ONE_GPU, cm.Assumptions())
  assert cm.step_comm_bytes(work, m, cm.Assumptions()) == 0
  assert math.isclose(t["total_s"], t["attention_busy_s"] + t["linear_s"], rel_tol=1e-12)


def test_csbp_sends_half_the_kv_of_cp_and_bp_none():
  m, a = _model(), cm.Assumptions()
  sent = {s: cm.step_comm_bytes(cm.plan_work(s, 1024, 16, 8), m, a) for s in cm.STRATEGIES}
  assert sent["csbp_ring"] == sent["cp_ring"] / 2
  assert sent["csbp_allgather"] == sent["cp_allgather"] / 2
  assert sent["bp"] == 0


def test_csbp_ring_steps_are_balanced_cp_ring_steps_are_not():
  """Zigzag over the whole [x_t; x_0] stream balances each rank's total but not each ring
  step; CSBP's clean zigzag and cp_ring_balanced's two zigzags balance both."""
  def step_imbalance(strategy, p=8):
    t = cm.plan_work(strategy, 2048, 16, p).travel_pairs
    steps = np.stack([t[np.arange(p), (np.arange(p) - s) % p] for s in range(p)], axis=1)
    return steps.max(axis=0).sum() / steps.sum(axis=1).max()

  assert step_imbalance("csbp_ring") == pytest.approx(1.0)
  assert step_imbalance("cp_ring_balanced") == pytest.approx(1.0)
  assert step_imbalance("cp_ring") > 1.8


def test_ring_hides_a_hop_under_a_longer_step_and_waits_for_a_slower_one():
  p, c = 4, 1.0
  busy = np.full((p, p), c)
  start = np.zeros(p)
  assert cm._ring_s(start, busy, kv_hop=0.5, grad_hop=0.0, overlap=True) == p * c
  assert cm._ring_s(start, busy, kv_hop=3.0, grad_hop=0.0, overlap=True) == (p - 1) * 3.0 + c
  assert cm._ring_s(start, busy, kv_hop=0.5, grad_hop=0.0, overlap=False) == p * c + 3 * 0.5
  uneven = busy.copy()
  uneven[0, 1] = 5.0  # one slow rank-step holds up its neighbours' next step
  assert cm._ring_s(start, uneven, kv_hop=0.5, grad_hop=0.0, overlap=True) == 5.0 + 3 * c


def test_projection_reports_speedups_and_memory_on_a_small_setting():
  rows = cm.project(cm.Hardware(), {"default": cm.Assumptions()}, seq_lens=(16384,),
                    block_sizes=(64,))["default"]
  assert len(rows) == len(cm.MODELS) * len(cm.STRATEGIES)
  assert all(r["total_s"] > 0 and r["total_bytes"] > 0 for r in rows)
  spd = cm.speedups(rows)[0]
  fitting = {r["strategy"]: r for r in rows if r["model"] == spd["model"] and r["fits"]}
  best = lambda names: min(fitting[s]["total_s"] for s in names if s in fitting)
  assert spd["csbp"] in ("csbp_ring", "csbp_allgather")
  assert spd["speedup"] == pytest.approx(best(cm.BASELINES) / best(("csbp_ring", "csbp_allgather")))
  assert spd["speedup"] > 1  # CSBP sends half of CP's K/V over the same ring: never slower


def test_compiled_memory_decides_the_verdict_where_the_probe_ran(tmp_path):
  path = tmp_path / "scale_probe.csv"
  head = ("model,seq_len,strategy,devices,layers,block_size,remat,depth_check,error,peak_bytes,"
          "standins\n")
  path.write_text(head + "llama3-8b,16384,csbp_ring,16,32,64,full,,,5e11,\n"
                  "llama3-8b,16384,cp_ring,16,32,64,full,,compile failed: X,,\n"
                  "llama3-8b,16384,bp,16,4,64,full,,,1e9,\n"
                  "qwen3-30b-a3b,16384,csbp_ring,16,48,64,full,,,3e11,False\n"
                  "qwen3-30b-a3b,16384,csbp_ring,16,48,64,full,,,1e11,True\n")
  compiled = cm.load_probe(str(path), cm.Hardware())
  # full depth, compiled; the MoE's ragged dispatch (stand-ins), not its all_gather one
  assert compiled == {("llama3-8b", 16384, 64, "csbp_ring"): 5e11,
                      ("qwen3-30b-a3b", 16384, 64, "csbp_ring"): 1e11}
  rows = cm.project(cm.Hardware(), {"default": cm.Assumptions()}, seq_lens=(16384,),
                    block_sizes=(64,), compiled=compiled)["default"]
  at = {(r["model"], r["strategy"]): r for r in rows}
  ring_key = ("llama3-8b", "csbp_ring")
  ring = at[ring_key]
  assert ring["memory_bytes"] == 5e11 and not ring["fits"] and ring["total_bytes"] < 5e11
  assumed = at[("llama3-8b", "cp_ring")]
  assert assumed["compiled_bytes"] is None and assumed["memory_bytes"] == assumed["total_bytes"]
  text = "\n".join(cm._memory_table(rows, cm.Hardware(), "scale_probe.csv"))
  assert f"2 of {len(rows)} verdicts compiled" in text and "OOM (compiled)" in text
  other_block = cm.project(cm.Hardware(), {"default": cm.Assumptions()}, seq_lens=(16384,),
                           block_sizes=(16,), compiled=compiled)["default"]
  ring16 = next(r for r in other_block if (r["model"], r["strategy"]) == ring_key)
  assert ring16["compiled_bytes"] == 5e11 and not ring16["compiled_here"] and not ring16["fits"]


def test_kernel_csv_sets_attention_tflops_from_pallas_fwd_bwd_on_bdlm_masks(tmp_path):
  """Only our kernel's training work counts: not its forward alone, not a peer, not the
  causal sanity rows, not an untimed (skipped) row."""
  from experiments.kernel_bench import FIELDS
  path = tmp_path / "kernel_bench.csv"
  rows = [("bdlm", "pallas", "fwd+bwd", "100"), ("bdlm", "pallas", "fwd+bwd", "300"),
          ("bdlm", "pallas", "fwd+bwd", "200"), ("bdlm", "pallas", "fwd+bwd", ""),
          ("bdlm", "pallas", "fwd", "900"), ("bdlm", "cudnn", "fwd+bwd", "900"),
          ("causal", "pallas", "fwd+bwd", "900")]
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=FIELDS, restval="")
    writer.writeheader()
    writer.writerows(dict(mask=m, peer=p, mode=mode, useful_tflops=t) for m, p, mode, t in rows)
  hw, note = cm.calibrate(cm.Hardware(), str(path))
  assert hw.attention_tflops == 200 and "3 pallas fwd+bwd rows" in note
  assert cm.calibrate(cm.Hardware(), None)[0] == cm.Hardware()


def test_results_readme_joins_the_sections_in_order(tmp_path):
  (tmp_path / "cost_model.md").write_text("COST")
  (tmp_path / "parallel_bench.md").write_text("BENCH")
  text = open(cm.write_results_readme(str(tmp_path))).read()
  assert text.index("BENCH") < text.index("COST")


def test_gemma3_preset_has_five_local_layers_per_global_one():
  m = cm.MODELS["gemma3-27b"]
  assert cm.attention_kinds(m) == [(None, 10), (1024, 52)]
  assert all(cm.attention_kinds(cm.MODELS[name]) == [(None, cm.MODELS[name].n_layers)]
             for name in ("llama3-8b", "qwen3-30b-a3b"))


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
@pytest.mark.parametrize("window", [8, 200])  # the windowed exchange, or not for every plan
def test_local_layers_compute_each_ranks_windowed_pairs(strategy, window):
  """Whichever transport a local layer takes, its busiest rank computes its windowed pairs."""
  m, a = _model(layer_pattern="local", sliding_window=window), cm.Assumptions()
  work = cm.plan_work(strategy, 128, 16, 4)
  t = cm.step_time(m, work, cm.Hardware(nodes=1, gpus_per_node=4), a)
  pair_s = 4 * m.n_heads * m.head_dim / (cm.Hardware().attention_tflops * 1e12)
  busy = m.n_layers * (1 + a.attention_bwd_factor) * work.plan.attention_work(window).max()
  assert t["attention_busy_s"] == pytest.approx(busy * pair_s, rel=1e-12)
  unskipped = cm.step_time(m, work, cm.Hardware(nodes=1, gpus_per_node=4),
                           cm.Assumptions(tile_skipping=False))
  assert unskipped["attention_busy_s"] >= t["attention_busy_s"]


@pytest.mark.parametrize("strategy", cm.STRATEGIES)
def test_comm_bytes_per_layer_kind_equal_the_configs_attention_traffic(strategy):
  cfg = replace(Config(), model=dict(LOCAL, compute_dtype="bfloat16"),
                data=dict(seq_len=128), objective=dict(block_size=16),
                parallel=dict(strategy=strategy, seq=4), train=dict(batch_size=1))
  a = cm.Assumptions(meta_bytes_per_row=META_ROW_BYTES)
  work = cm.plan_work(strategy, 128, 16, 4)
  assert cm.step_comm_bytes(work, cfg.model, a) == wire_bytes(config_attention_traffic(cfg), 4)


def test_csbp_local_layers_exchange_their_window_and_save_it():
  """At long L the windowed exchange sends a few blocks, not the ring's clean half; remat
  keeps the received rows, so each local layer saves them."""
  m, hw, a = cm.MODELS["gemma3-27b"], cm.Hardware(), cm.Assumptions()
  work = cm.plan_work("csbp_ring", 131072, 64, hw.num_gpus)
  assert window_transport(work.plan, m.sliding_window) == "exchange"
  received = exchange_for(work.plan, m.sliding_window).rows_sent()
  all_global = dataclasses.replace(m, layer_pattern="global")
  kv_row = 2 * m.n_kv_heads * m.head_dim
  local_sent = cm.step_comm_bytes(work, m, a) - cm.step_comm_bytes(
      work, dataclasses.replace(m, n_layers=10, layer_pattern="global"), a)
  assert local_sent == 52 * received * (2 * kv_row * a.compute_bytes + a.meta_bytes_per_row)
  assert local_sent < cm.step_comm_bytes(work, all_global, a) / 10
  saved = cm.peak_memory(m, work, hw, a)["saved_bytes"]
  assert saved - cm.peak_memory(all_global, work, hw, a)["saved_bytes"] == (
      52 * received * (kv_row * a.compute_bytes + a.meta_bytes_per_row))
  assert cm.step_time(m, work, hw, a)["total_s"] < cm.step_time(all_global, work, hw, a)["total_s"]


def test_probe_rows_of_a_model_with_local_layers_are_its_memory(tmp_path):
  """scale_probe.csv does not record the layer pattern: its gemma3-27b rows ran all global,
  and stay that model's compiled memory (the assumption reads about half of any compile)."""
  path = tmp_path / "scale_probe.csv"
  path.write_text("model,seq_len,strategy,devices,layers,block_size,remat,depth_check,error,"
                  "peak_bytes,standins\n"
                  "gemma3-27b,16384,csbp_ring,16,62,64,full,,,5e10,\n"
                  "llama3-8b,16384,csbp_ring,16,32,64,full,,,5e10,\n")
  assert cm.load_probe(str(path), cm.Hardware()) == {
      (model, 16384, 64, "csbp_ring"): 5e10 for model in ("gemma3-27b", "llama3-8b")}


# DFlash drafter training: a small target and drafter, L = 128, B = 4, A = 8, on 4 GPUs.
DFLASH_P = 4
DFLASH_HW = cm.Hardware(nodes=1, gpus_per_node=DFLASH_P, hbm_gb=80.0)


def _dflash_cfg(anchors=8):
  target = _model(n_layers=4, qk_norm=True, tie_embeddings=False)
  return cm.dflash_config(128, anchors, target=target, draft_layers=2, block_size=4)


@pytest.mark.parametrize("anchors", [8, 12])
def test_dflash_useful_flops_equal_model_flops_per_step(anchors):
  """The target's causal forward once, the drafter's training three times."""
  cfg = _dflash_cfg(anchors)
  assert math.isclose(cm.dflash_useful_flops(cfg), model_flops_per_step(cfg), rel_tol=1e-12)


def test_dflash_param_counts_equal_the_flax_target_and_drafter():
  cfg = _dflash_cfg()
  params = abstract_params(cfg)
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  assert cm.drafter_params(cfg) == count(params["drafter"])
  assert cm.param_count(cfg.model) == count(params["target"])


@pytest.mark.parametrize("strategy", cm.DFLASH_STRATEGIES)
def test_draft_pairs_split_by_kv_owner_sum_to_attention_work(strategy):
  p = 1 if strategy == "none" else DFLASH_P
  work = cm.draft_work(strategy, 128, 4, p, 8)
  per_rank = work.stay_pairs + work.travel_pairs.sum(axis=1)
  np.testing.assert_array_equal(per_rank, work.plan.attention_work())
  assert (work.travel_pairs == 0).all() == (strategy in ("none", "bp"))


def test_csbp_drafter_moves_context_kv_cp_also_draft_kv_bp_nothing():
  """Per GPU: the target's context K/V one way (P-1 ring hops, on the layers it runs) under
  cp and csbp alike; per
  drafter layer, the ring's P-1 hops each way and P dK/dV hops, of L/P context rows under
  csbp and of those plus A*B/P draft rows under cp."""
  cfg, a = _dflash_cfg(), cm.Assumptions()
  m, d = cfg.model, cm.drafter_model(cfg)
  sent = {s: cm.dflash_comm_bytes(cfg, *cm.dflash_works(s, cfg, DFLASH_P), a)
          for s in ("cp_ring", "csbp_ring", "bp")}
  kv_row = lambda model: 2 * model.n_kv_heads * model.head_dim
  ring = lambda rows: d.n_layers * rows * (
      2 * (DFLASH_P - 1) * (kv_row(d) * a.compute_bytes + a.meta_bytes_per_row)
      + DFLASH_P * kv_row(d) * a.kv_grad_bytes)
  ctx_rows, draft_rows = 128 // DFLASH_P, 8 * 4 // DFLASH_P
  target = cm.target_depth(cfg) * (DFLASH_P - 1) * ctx_rows * (
      kv_row(m) * a.compute_bytes + a.meta_bytes_per_row)  # the layers up to the last chosen
  assert sent["csbp_ring"] == target + ring(ctx_rows)
  assert sent["cp_ring"] == target + ring(ctx_rows + draft_rows)
  assert sent["bp"] == 0


def test_bp_repeats_the_targets_forward_on_every_gpu_csbp_splits_it():
  cfg, a = _dflash_cfg(), cm.Assumptions()
  rows = cm.dflash_project(DFLASH_HW, a, seq_lens=(128,), anchors=(("8", lambda _: 8),),
                           target=cfg.model, draft_layers=2)
  at = {r["strategy"]: r for r in rows}
  for part in ("target_linear_s", "target_attention_busy_s"):
    assert at["bp"][part] == pytest.approx(DFLASH_P * at["csbp_ring"][part], rel=1e-12)
    assert at["none"][part] == pytest.approx(at["bp"][part], rel=1e-12)
  assert at["none"]["seq_s"] == pytest.approx(at["none"]["total_s"] / DFLASH_P)
  assert at["bp"]["held_bytes"] > at["csbp_ring"]["held_bytes"]
  spd = cm.dflash_speedups(rows)
  assert len(spd) == 1 and spd[0]["csbp"] in cm.DFLASH_CSBP
  fitting = [r for r in rows if r["strategy"] in cm.DFLASH_BASELINES and r["fits"]]
  base = min(fitting, key=lambda r: r["seq_s"])
  assert spd[0]["baseline"] == base["strategy"]
  assert spd[0]["speedup"] == pytest.approx(base["seq_s"] / at[spd[0]["csbp"]]["seq_s"])
  text = "\n".join(cm._dflash_section(DFLASH_HW, a, rows, spd))
  assert "2.48x" in text and "7.59x" in text and "| csbp_ring |" in text
