"""The cost model (bdlm_jax.analysis.cost_model) against figures it does not compute itself:
a brute-force count of the mask for its pairs, the Flax model's parameters, hand-worked
FLOPs, the traced train step's MoE exchange and the compiled layers' traffic; and the rules
of its ring, memory verdicts and reports."""

import csv
import dataclasses
import math
import os

import jax
import numpy as np
import pytest

from bdlm_jax import loss_fn, make_batch, make_mesh
from bdlm_jax.analysis.cost_model import dflash, report, setting, timing
from bdlm_jax.analysis.cost_model.memory import Compiled, load_probe, peak_memory
from bdlm_jax.analysis.cost_model.projection import BASELINES, CSBP, STRATEGIES, project, speedups
from bdlm_jax.analysis.cost_model.work import (expert_params, expert_slots, plan_work,
                                               step_comm_bytes)
from bdlm_jax.analysis.hlo_stats import wire_bytes
from bdlm_jax.analysis.probe import attention_layer_costs
from bdlm_jax.analysis.results import PAGES, write_results_pages
from bdlm_jax.analysis.step_report import config_attention_traffic
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import CLEAN, NOISY, RowMeta, allowed, windowed
from bdlm_jax.metrics import linear_flops_per_row, model_flops_per_step, param_count
from bdlm_jax.models.drafter import drafter_model, target_depth
from bdlm_jax.objectives.dflash import locality_run
from bdlm_jax.params import abstract_params
from bdlm_jax.parallel.layout import PAD
from bdlm_jax.parallel.registry import SINGLE_DEVICE, get_strategy, make_plan, strategy_names
from bdlm_jax.parallel.strategies import exchange_for, window_transport

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
             d_ff=128)
MOE = dict(SMALL, moe_experts=8, moe_top_k=2, moe_d_ff=32, moe_norm_topk=True)
LOCAL = dict(SMALL, n_layers=3, layer_pattern="local,local,global", sliding_window=20)
ONE_GPU = setting.Hardware(nodes=1, gpus_per_node=1)
Assumptions = setting.Assumptions


def _model(**kw):
  return replace(Config(), model=dict(SMALL, **kw)).model


def _logical_meta(plan) -> RowMeta:
  """RowMeta [1, rows] of every logical row, by the rules of kernels/mask.py and
  objectives/dflash.py (a draft row: its anchor's block and position; a drafter's context
  row: a block of its own)."""
  n, b = plan.noisy_len, plan.block_size
  rows = np.arange(n + plan.seq_len)
  noisy = rows < n
  if plan.draft_blocks:
    anchor = plan.block_starts()[np.where(noisy, rows, 0) // b]
    block = np.where(noisy, anchor, rows - n)
    pos = np.where(noisy, anchor + rows % b, rows - n)
  else:
    pos = np.where(noisy, rows, rows - n)
    block = pos // b
  stream = np.where(noisy, NOISY, CLEAN)
  return RowMeta(*(np.asarray(x, np.int32)[None] for x in (stream, block, rows * 0 + 1, pos,
                                                            rows * 0)))


def _brute_force_pairs(plan, keys, window=None):
  """int [P, G]: allowed (query, key) pairs of each rank's queries with each row group of
  `keys`, from the dense mask (a drafter's context rows are keys only)."""
  meta = _logical_meta(plan)
  take = lambda rows: RowMeta(*(x[:, rows[rows != PAD]] for x in meta))
  out = np.zeros((plan.num_ranks, len(keys)), np.int64)
  for r, q_rows in enumerate(plan.rows):
    if plan.draft_blocks:
      q_rows = q_rows[q_rows < plan.noisy_len]
    q = take(q_rows)
    if window is not None:
      q = RowMeta(*(np.asarray(x) for x in windowed(q, window, plan.block_size)))
    for g, k_rows in enumerate(keys):
      out[r, g] = int(np.asarray(allowed(q, take(k_rows))).sum())
  return out


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("block_size,draft_blocks", [(4, 0), (16, 0), (24, 0), (4, 8)])
def test_pairs_split_by_kv_owner_equal_a_brute_force_count_of_the_mask(strategy, block_size,
                                                                       draft_blocks):
  """N > 2P, N = 2P, P < N < 2P blocks (P = 4), and a drafter's 8 draft blocks; the one
  layout these sizes do not divide into, and a drafter-only one without drafts, are refused,
  saying why."""
  p = 4 if get_strategy(strategy).splits_sequences else 1
  if get_strategy(strategy).needs_drafter and not draft_blocks:
    with pytest.raises(ConfigError, match="needs a drafter objective"):
      plan_work(strategy, 96, block_size, p)
    return
  if strategy == "cp_ring_balanced" and 96 % (2 * p * block_size):
    with pytest.raises(ConfigError, match=r"data.seq_len=96 must be divisible by "
                       rf"2\*parallel.seq\*objective.block_size={2 * p * block_size}"):
      plan_work(strategy, 96, block_size, p, draft_blocks=draft_blocks)
    return
  work = plan_work(strategy, 96, block_size, p, draft_blocks=draft_blocks)
  plan, split = work.plan, work.n_stay
  np.testing.assert_array_equal(work.travel_pairs, _brute_force_pairs(plan, plan.rows[:, split:]))
  stay = _brute_force_pairs(plan, plan.rows[:, :split])
  np.testing.assert_array_equal(work.stay_pairs, np.diagonal(stay))


@pytest.mark.parametrize("strategy", strategy_names(splits_sequences=True, needs_drafter=False))
@pytest.mark.parametrize("window", [3, 20])
def test_windowed_pairs_split_by_kv_owner_equal_a_brute_force_count_of_the_mask(strategy,
                                                                                window):
  plan = make_plan(strategy, 64, 4, 4)
  keys = plan.rows[:, plan.n_stay:]
  np.testing.assert_array_equal(plan.attention_work(window, keys=keys),
                                _brute_force_pairs(plan, keys, window))


def test_attention_pairs_are_L_times_L_plus_B():
  """Noisy and clean streams each hold B^2 N(N+1)/2 pairs, so pairs = L(L+B): doubling L
  quadruples attention FLOPs only up to the in-block term, pairs(2L) = 4 pairs(L) - 2LB."""
  pairs = lambda L, B: int(make_plan(SINGLE_DEVICE, L, B, 1).attention_work().sum())
  for L, B in [(64, 4), (256, 16), (1024, 256)]:
    assert pairs(L, B) == L * (L + B)
    assert pairs(2 * L, B) == 4 * pairs(L, B) - 2 * L * B


@pytest.mark.parametrize("model", [SMALL, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_equals_the_flax_model(model, tie):
  """In total, and active: an MoE's expert weights ([layers, E, ...]) counted k / E."""
  cfg = replace(Config(), model=dict(model, tie_embeddings=tie))
  m = cfg.model
  leaves = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
  expert = lambda path, x: "mlp" in jax.tree_util.keystr(path) and x.ndim == 4
  active = sum(x.size * m.moe_top_k // m.moe_experts if expert(path, x) else x.size
               for path, x in leaves)
  assert param_count(m) == sum(x.size for _, x in leaves)
  assert param_count(m, active=True) == active
  assert expert_params(m) == sum(x.size for path, x in leaves if expert(path, x))


def test_moe_flops_count_the_router_and_the_k_experts_a_row_uses():
  """By hand, per row and layer of MOE: q, k, v, o 2 * 64 * (64 + 32 + 32 + 64) = 24576;
  router 2 * 64 * 8 = 1024; 2 of 8 experts 2 * 2 * 3 * 64 * 32 = 24576: 50176, two layers."""
  m = _model(**MOE)
  assert linear_flops_per_row(m) == 2 * 50176
  work = plan_work("csbp_ring", 128, 16, 4)
  hw, a = setting.Hardware(nodes=1, gpus_per_node=4), Assumptions()
  t = timing.step_time(m, work, hw, a)
  logits = 3 * 2 * work.plan.n_noisy * m.d_model * m.vocab_size
  linear = work.plan.rows_per_rank * 2 * 50176 * (3 + a.remat_forward)
  assert t["linear_s"] == pytest.approx((linear + logits) / (hw.matmul_tflops * 1e12))
  real = setting.MODELS["qwen3-30b-a3b"]  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
  assert 30e9 < param_count(real) < 31e9 and 3.2e9 < param_count(real, active=True) < 3.5e9


def _ragged_all_to_alls(jaxpr, times=1):
  """(times run, operand) of every ragged_all_to_all in a jaxpr and the jaxprs inside it."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ragged_all_to_all":
      out.append((times, eqn.invars[0].aval))
    inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out += _ragged_all_to_alls(sub, inner)
  return out


def test_moe_exchange_is_what_the_traced_train_step_sends():
  """The ragged dispatch's all-to-alls in the gradient of the real loss (full remat, experts
  over 4 seq devices): each sends a device's (token, expert) pairs of d_model in the compute
  dtype, there and back in the forward, the remat's forward and the backward."""
  cfg = replace(Config(), model=dict(MOE, compute_dtype="bfloat16", remat="full"),
                data=dict(seq_len=32), objective=dict(block_size=4), train=dict(batch_size=1),
                parallel=dict(strategy="csbp_ring", seq=4, expert_axes="seq",
                              moe_dispatch="ragged_all_to_all"))
  mesh = make_mesh(cfg)
  batch = make_batch(cfg, np.random.default_rng(0).integers(0, 200, (1, 32)))
  grad = jax.grad(lambda p: loss_fn(p, batch, jax.random.key(0), cfg, mesh)[0])
  sends = _ragged_all_to_alls(jax.make_jaxpr(grad)(abstract_params(cfg)).jaxpr)
  pairs = min(x.shape[0] for _, x in sends)  # a device's pairs: the send buffer's rows
  traced = sum(n * pairs * x.shape[1] * x.dtype.itemsize for n, x in sends)
  rows = 2 * 32 // 4
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  sent, seconds = timing.moe_exchange(cfg.model, rows, hw, Assumptions())
  assert sent == traced and seconds > 0
  assert timing.moe_exchange(cfg.model, rows, ONE_GPU, Assumptions()) == (0.0, 0.0)
  assert timing.moe_exchange(_model(), rows, hw, Assumptions()) == (0.0, 0.0)
  # and the experts' receive buffer, every member's pairs (no capacity)
  assert expert_slots(cfg.model, rows, 4) == (pairs, max(x.shape[0] for _, x in sends))


def test_moe_memory_holds_every_expert_and_zero3_moves_none():
  m, hw, a = setting.MODELS["qwen3-30b-a3b"], setting.Hardware(), Assumptions()
  memory = peak_memory(m, plan_work("csbp_ring", 16384, 64, hw.num_gpus), hw, a)
  assert memory["states_bytes"] == param_count(m) * a.state_bytes_per_param / hw.num_gpus
  pairs, slots = expert_slots(m, 2 * 262144 // hw.num_gpus, hw.num_gpus)
  assert slots == 1.25 * pairs  # receive buffers sized by the capacity factor
  llama = setting.MODELS["llama3-8b"]  # 30B parameters, but only the 1.5B non-experts gathered
  assert param_count(m) > 3 * param_count(llama)
  assert timing.param_traffic_s(m, hw, a) < timing.param_traffic_s(llama, hw, a)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_sends_nothing_and_only_computes(strategy):
  m = _model()
  work = plan_work(strategy, 256, 16, 1)
  t = timing.step_time(m, work, ONE_GPU, Assumptions())
  assert step_comm_bytes(work, m, Assumptions()) == 0
  assert math.isclose(t["total_s"], t["attention_busy_s"] + t["linear_s"], rel_tol=1e-12)


def test_csbp_sends_half_the_kv_of_cp_and_bp_none():
  m, a = _model(), Assumptions()
  sent = {s: step_comm_bytes(plan_work(s, 1024, 16, 8), m, a) for s in STRATEGIES}
  for csbp in CSBP:
    transport = get_strategy(csbp).transport
    assert sent[csbp] == sent[strategy_names(baseline=True, transport=transport)[0]] / 2
  assert all(sent[s] == 0 for s in strategy_names(splits_sequences=True, transport="local"))


def test_csbp_ring_steps_are_balanced_cp_ring_steps_are_not():
  """Zigzag over the whole [x_t; x_0] stream balances each rank's total but not each ring
  step; CSBP's clean zigzag and cp_ring_balanced's two zigzags balance both."""
  def step_imbalance(strategy, p=8):
    steps = timing.ring_steps(plan_work(strategy, 2048, 16, p).travel_pairs)
    return steps.max(axis=0).sum() / steps.sum(axis=1).max()

  assert step_imbalance("csbp_ring") == pytest.approx(1.0)
  assert step_imbalance("cp_ring_balanced") == pytest.approx(1.0)
  assert step_imbalance("cp_ring") > 1.8


def test_ring_hides_a_hop_under_a_longer_step_and_waits_for_a_slower_one():
  p, c = 4, 1.0
  busy = np.full((p, p), c)
  start = np.zeros(p)
  assert timing.ring_s(start, busy, kv_hop=0.5, grad_hop=0.0, overlap=True) == p * c
  assert timing.ring_s(start, busy, kv_hop=3.0, grad_hop=0.0, overlap=True) == (p - 1) * 3.0 + c
  assert timing.ring_s(start, busy, kv_hop=0.5, grad_hop=0.0, overlap=False) == p * c + 3 * 0.5
  uneven = busy.copy()
  uneven[0, 1] = 5.0  # one slow rank-step holds up its neighbours' next step
  assert timing.ring_s(start, uneven, kv_hop=0.5, grad_hop=0.0, overlap=True) == 5.0 + 3 * c


def test_projection_reports_speedups_and_memory_on_a_small_setting():
  rows = project(setting.Hardware(), {"default": Assumptions()}, seq_lens=(16384,),
                 block_sizes=(64,))["default"]
  assert len(rows) == len(setting.MODELS) * len(STRATEGIES)
  assert all(r["total_s"] > 0 and r["total_bytes"] > 0 for r in rows)
  spd = speedups(rows)[0]
  fitting = {r["strategy"]: r for r in rows if r["model"] == spd["model"] and r["fits"]}
  best = lambda names: min(fitting[s]["total_s"] for s in names if s in fitting)
  assert spd["csbp"] in CSBP
  assert spd["speedup"] == pytest.approx(best(BASELINES) / best(CSBP))
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
  compiled = load_probe(str(path), setting.Hardware())
  # full depth, compiled; the MoE's ragged dispatch (stand-ins), not its all_gather one
  cpu = lambda nbytes: Compiled(nbytes, "XLA:CPU", "bound")
  assert compiled == {("llama3-8b", 16384, 64, "csbp_ring"): cpu(5e11),
                      ("qwen3-30b-a3b", 16384, 64, "csbp_ring"): cpu(1e11)}
  rows = project(setting.Hardware(), {"default": Assumptions()}, seq_lens=(16384,),
                 block_sizes=(64,), compiled=compiled)["default"]
  at = {(r["model"], r["strategy"]): r for r in rows}
  ring_key = ("llama3-8b", "csbp_ring")
  ring = at[ring_key]
  assert ring["memory_bytes"] == 5e11 and not ring["fits"] and ring["total_bytes"] < 5e11
  assumed = at[("llama3-8b", "cp_ring")]
  assert assumed["compiled_bytes"] is None and assumed["memory_bytes"] == assumed["total_bytes"]
  assert assumed["memory_source"] == "assumed"
  text = "\n".join(report._memory_table(rows, setting.Hardware(), "`scale_probe.csv`"))
  assert f"2 of {len(rows)} verdicts compiled (2 by XLA:CPU bound" in text
  assert "| OOM (XLA:CPU bound 500.0 GB of 134) |" in text
  other_block = project(setting.Hardware(), {"default": Assumptions()}, seq_lens=(16384,),
                        block_sizes=(16,), compiled=compiled)["default"]
  ring16 = next(r for r in other_block if (r["model"], r["strategy"]) == ring_key)
  assert ring16["compiled_bytes"] == 5e11 and not ring16["compiled_here"] and not ring16["fits"]


def test_the_verdict_takes_the_accelerator_compilers_peak_over_xla_cpus_bound(tmp_path):
  """An XLA:TPU row (its own peak, 60 GB) decides where it compiled, and says so; where it
  did not compile (over a v5p's HBM), XLA:CPU's bound (200 GB) decides, and says so."""
  head = ("model,seq_len,strategy,devices,layers,block_size,remat,depth_check,error,"
          "peak_bytes,standins,target,compiler_peak_bytes\n")
  tpu, cpu = tmp_path / "scale_probe_tpu.csv", tmp_path / "scale_probe.csv"
  tpu.write_text(head + "llama3-8b,16384,csbp_ring,16,32,64,full,,,6e10,False,tpu:v5p:2x2x4,6e10\n"
                 "llama3-8b,16384,cp_ring,16,32,64,full,,compile failed: RESOURCE_EXHAUSTED,,"
                 "False,tpu:v5p:2x2x4,\n")
  cpu.write_text(head + "llama3-8b,16384,csbp_ring,16,32,64,full,,,2e11,,,\n"
                 "llama3-8b,16384,cp_ring,16,32,64,full,,,2e11,,,\n")
  compiled = load_probe([str(tpu), str(cpu)], setting.Hardware())
  assert compiled[("llama3-8b", 16384, 64, "csbp_ring")] == Compiled(6e10, "XLA:TPU", "peak")
  assert compiled[("llama3-8b", 16384, 64, "cp_ring")] == Compiled(2e11, "XLA:CPU", "bound")
  rows = project(setting.Hardware(), {"default": Assumptions()}, seq_lens=(16384,),
                 block_sizes=(64,), compiled=compiled)["default"]
  text = "\n".join(report._memory_table(rows, setting.Hardware(), "`x`"))
  assert "1 by XLA:CPU bound, 1 by XLA:TPU peak" in text
  assert "| csbp_ring |" in text and "| fits (XLA:TPU peak 60.0 GB of 134) |" in text
  assert "| OOM (XLA:CPU bound 200.0 GB of 134) |" in text
  table = "\n".join(report._strategy_table(rows, speedups(rows)))
  assert " / 60 *tpu* |" in table and " / 200 *cpu* **OOM** |" in table


def test_an_moes_ragged_dispatch_compiled_for_real_is_read_before_its_stand_ins(tmp_path):
  path = tmp_path / "scale_probe_tpu.csv"
  path.write_text("model,seq_len,strategy,devices,layers,block_size,remat,overrides,depth_check,"
                  "error,peak_bytes,standins,target\n"
                  "qwen3-30b-a3b,16384,csbp_ring,16,48,64,full,,,,3e11,False,tpu:v5p:2x2x4\n"
                  "qwen3-30b-a3b,16384,csbp_ring,16,48,64,full,,,,2e11,True,tpu:v5p:2x2x4\n"
                  "qwen3-30b-a3b,16384,csbp_ring,16,48,64,full,parallel.moe_dispatch="
                  "ragged_all_to_all,,,1e11,False,tpu:v5p:2x2x4\n")
  key = ("qwen3-30b-a3b", 16384, 64, "csbp_ring")
  assert load_probe(str(path), setting.Hardware())[key].nbytes == 1e11
  path.write_text("\n".join(path.read_text().splitlines()[:3]) + "\n")  # stand-ins only
  assert load_probe(str(path), setting.Hardware())[key].nbytes == 2e11


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
  hw, note = setting.calibrate(setting.Hardware(), str(path))
  assert hw.attention_tflops == 200 and "3 pallas fwd+bwd rows" in note
  assert setting.calibrate(setting.Hardware(), None)[0] == setting.Hardware()


def test_results_pages_join_their_sections_in_order_beside_a_scratch_folder(tmp_path):
  """A page per topic that has a section; a scratch folder gets its pages beside them."""
  (tmp_path / "cost_model_scaling.md").write_text("SCALING")
  (tmp_path / "cost_model.md").write_text("COST")
  (tmp_path / "parallel_bench.md").write_text("BENCH")
  written = write_results_pages(str(tmp_path))
  assert sorted(written) == [str(tmp_path / "projections.md"),
                             str(tmp_path / "strategies_measured.md")]
  text = (tmp_path / "projections.md").read_text()
  assert text.startswith("# Cost model") and text.index("COST") < text.index("SCALING")
  assert "BENCH" in (tmp_path / "strategies_measured.md").read_text()


def test_the_repositorys_results_folder_writes_docs_results(tmp_path):
  """Only a results folder at <repo>/experiments/results writes <repo>/docs/results/, its
  images linked from there."""
  results = tmp_path / "experiments" / "results"
  results.mkdir(parents=True)
  (results / "block_size_sweep.md").write_text("## Sweep\n\nSWEEP\n")
  (results / "block_size_sweep.png").write_bytes(b"png")
  write_results_pages(str(results))
  page = (tmp_path / "docs" / "results" / "block_sizes.md").read_text()
  assert "## Sweep\n\nSWEEP" in page
  assert "(../../experiments/results/block_size_sweep.png)" in page
  assert not (results / "block_sizes.md").exists()


def test_the_docs_results_pages_hold_the_committed_sections():
  """docs/results/ is what the committed sections make: nothing edited by hand, none stale."""
  results = os.path.join(REPO, "experiments", "results")
  for page in PAGES:
    with open(os.path.join(REPO, "docs", "results", page.name)) as f:
      text = f.read()
    for name in page.sections:
      with open(os.path.join(results, name)) as f:
        assert f.read().strip() in text, (page.name, name)


def test_gemma3_preset_has_five_local_layers_per_global_one():
  from bdlm_jax.analysis.cost_model.work import attention_kinds
  assert attention_kinds(setting.MODELS["gemma3-27b"]) == [(None, 10), (1024, 52)]
  assert all(attention_kinds(setting.MODELS[name]) == [(None, setting.MODELS[name].n_layers)]
             for name in ("llama3-8b", "qwen3-30b-a3b"))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("window", [8, 200])  # the windowed exchange, or not for every plan
def test_local_layers_compute_each_ranks_windowed_pairs(strategy, window):
  """Whichever transport a local layer takes, its busiest rank computes its windowed pairs."""
  m, a = _model(layer_pattern="local", sliding_window=window), Assumptions()
  work = plan_work(strategy, 128, 16, 4)
  hw = setting.Hardware(nodes=1, gpus_per_node=4)
  t = timing.step_time(m, work, hw, a)
  every_key = np.arange(2 * 128)[None]
  busy = m.n_layers * (1 + a.attention_bwd_factor) * _brute_force_pairs(
      work.plan, every_key, window).max()
  pair_s = 4 * m.n_heads * m.head_dim / (hw.attention_tflops * 1e12)  # QK^T and PV: 2 x 2 FLOPs
  assert t["attention_busy_s"] == pytest.approx(busy * pair_s, rel=1e-12)
  unskipped = timing.step_time(m, work, hw, Assumptions(tile_skipping=False))
  assert unskipped["attention_busy_s"] >= t["attention_busy_s"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_comm_bytes_per_layer_kind_equal_the_configs_attention_traffic(strategy):
  """The default assumptions move the row metadata the runtime sends (`RowMeta`'s fields)."""
  cfg = replace(Config(), model=dict(LOCAL, compute_dtype="bfloat16"),
                data=dict(seq_len=128), objective=dict(block_size=16),
                parallel=dict(strategy=strategy, seq=4), train=dict(batch_size=1))
  work = plan_work(strategy, 128, 16, 4)
  assert step_comm_bytes(work, cfg.model, Assumptions()) == wire_bytes(
      config_attention_traffic(cfg), 4)


# A global layer, or a local one of W = 8 of L = 128. An all-gather layer compiled alone
# reuses its forward gather in the backward (the train step's remat gathers again).
COMPILED_LAYERS = ([(s, None) for s in STRATEGIES if get_strategy(s).transport != "allgather"]
                   + [(s, 8) for s in STRATEGIES])


@pytest.mark.parametrize("strategy,window", COMPILED_LAYERS)
def test_a_layer_sends_what_the_compiled_layer_sends(strategy, window):
  """One attention layer, forward + backward, compiled on 4 devices in f32: its collectives,
  as ring algorithms send them, are the model's bytes at the default assumptions (K/V, their
  gradients and each row's metadata; a local layer's windowed exchange where it is used)."""
  seq_len, block, p = 128, 8, 4
  compiled = attention_layer_costs(strategy, seq_len, p, block, n_heads=4, n_kv_heads=2,
                                   head_dim=16, window=window)["collective_bytes"]
  kind = dict(layer_pattern="local", sliding_window=window) if window else {}
  m = _model(n_layers=1, **kind)
  f32 = Assumptions(compute_bytes=4, kv_grad_bytes=4)
  assert step_comm_bytes(plan_work(strategy, seq_len, block, p), m, f32) == wire_bytes(
      compiled, p)


def test_csbp_local_layers_exchange_their_window_and_save_it():
  """At long L the windowed exchange sends a few blocks, not the ring's clean half; remat
  keeps the received rows, so each local layer saves them."""
  m, hw, a = setting.MODELS["gemma3-27b"], setting.Hardware(), Assumptions()
  work = plan_work("csbp_ring", 131072, 64, hw.num_gpus)
  assert window_transport(work.plan, m.sliding_window) == "exchange"
  all_global = dataclasses.replace(m, layer_pattern="global")
  assert step_comm_bytes(work, m, a) < step_comm_bytes(work, all_global, a) / 5
  received = exchange_for(work.plan, m.sliding_window).rows_sent()
  saved = peak_memory(m, work, hw, a)["saved_bytes"] - peak_memory(all_global, work, hw,
                                                                     a)["saved_bytes"]
  assert saved > 52 * received * 2 * m.n_kv_heads * m.head_dim * a.compute_bytes
  assert timing.step_time(m, work, hw, a)["total_s"] < timing.step_time(all_global, work, hw,
                                                                         a)["total_s"]


def test_probe_rows_of_a_model_with_local_layers_are_its_memory(tmp_path):
  """scale_probe.csv does not record the layer pattern: its gemma3-27b rows ran all global,
  and stay that model's compiled memory (the assumption reads about half of any compile)."""
  path = tmp_path / "scale_probe.csv"
  path.write_text("model,seq_len,strategy,devices,layers,block_size,remat,depth_check,error,"
                  "peak_bytes,standins\n"
                  "gemma3-27b,16384,csbp_ring,16,62,64,full,,,5e10,\n"
                  "llama3-8b,16384,csbp_ring,16,32,64,full,,,5e10,\n")
  assert load_probe(str(path), setting.Hardware()) == {
      (model, 16384, 64, "csbp_ring"): Compiled(5e10, "XLA:CPU", "bound")
      for model in ("gemma3-27b", "llama3-8b")}


# DFlash drafter training: a small target and drafter, L = 128, B = 4, A = 8, on 4 GPUs.
DFLASH_P = 4
DFLASH_HW = setting.Hardware(nodes=1, gpus_per_node=DFLASH_P, hbm_gb=80.0)


def _dflash_cfg(anchors=8):
  target = _model(n_layers=4, qk_norm=True, tie_embeddings=False)
  return dflash.dflash_config(128, anchors, target=target, draft_layers=2, block_size=4)


def test_dflash_param_counts_equal_the_flax_target_and_drafter():
  cfg = _dflash_cfg()
  params = abstract_params(cfg)
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  assert dflash.drafter_params(cfg) == count(params["drafter"])
  assert param_count(cfg.model) == count(params["target"])


def test_drafter_strategies_are_those_with_a_plan_of_their_own():
  """A drafter's cp_ring_balanced zigzags each stream as cp_ring does: projected once."""
  rows = dflash.dflash_project(DFLASH_HW, Assumptions(), seq_lens=(128,),
                               anchors=(("8", lambda _: 8),), target=_dflash_cfg().model,
                               draft_layers=2)
  assert [r["strategy"] for r in rows] == [s for s in strategy_names()
                                           if s != "cp_ring_balanced"]


def test_drafter_moves_context_kv_and_what_its_plan_travels():
  """Per GPU: the target's context K/V one way (P-1 ring hops, on the layers it runs) where
  anything travels; per drafter layer, the ring's P-1 hops each way and P dK/dV hops, of the
  L/P context rows under csbp and of those plus A*B/P draft rows under cp; bp nothing."""
  cfg, a = _dflash_cfg(), Assumptions()
  m, d = cfg.model, drafter_model(cfg)
  kv_row = lambda model: 2 * model.n_kv_heads * model.head_dim
  ring = lambda rows: d.n_layers * rows * (
      2 * (DFLASH_P - 1) * (kv_row(d) * a.compute_bytes + a.meta_bytes_per_row)
      + DFLASH_P * kv_row(d) * a.kv_grad_bytes)
  ctx_rows, draft_rows = 128 // DFLASH_P, 8 * 4 // DFLASH_P
  target = target_depth(cfg) * (DFLASH_P - 1) * ctx_rows * (
      kv_row(m) * a.compute_bytes + a.meta_bytes_per_row)  # the layers up to the last chosen
  expected = {"all": target + ring(ctx_rows + draft_rows), "clean": target + ring(ctx_rows),
              "none": 0}
  for s in strategy_names(transport="ring") + strategy_names(splits_sequences=True,
                                                             transport="local"):
    drafter, _ = dflash.dflash_works(s, cfg, DFLASH_P)
    assert dflash.dflash_comm_bytes(cfg, drafter, a) == expected[get_strategy(s).travels], s


def test_bp_repeats_the_targets_forward_on_every_gpu_csbp_splits_it():
  cfg, a = _dflash_cfg(), Assumptions()
  rows = dflash.dflash_project(DFLASH_HW, a, seq_lens=(128,), anchors=(("8", lambda _: 8),),
                               target=cfg.model, draft_layers=2)
  at = {r["strategy"]: r for r in rows}
  for part in ("target_linear_s", "target_attention_busy_s"):
    assert at["bp"][part] == pytest.approx(DFLASH_P * at["csbp_ring"][part], rel=1e-12)
    assert at["none"][part] == pytest.approx(at["bp"][part], rel=1e-12)
  assert at["none"]["seq_s"] == pytest.approx(at["none"]["total_s"] / DFLASH_P)
  assert at["bp"]["held_bytes"] > at["csbp_ring"]["held_bytes"]
  spd = dflash.dflash_speedups(rows)
  assert len(spd) == 1 and spd[0]["csbp"] in CSBP
  fitting = [r for r in rows if r["strategy"] in BASELINES and r["fits"]]
  base = min(fitting, key=lambda r: r["seq_s"])
  csbp = at[spd[0]["csbp"]]
  assert spd[0]["baseline"] == base["strategy"]
  assert spd[0]["speedup"] == pytest.approx(base["seq_s"] / csbp["seq_s"])
  # The section shows each strategy's largest part and MFU, and CSBP over each baseline.
  lines = report._dflash_section(DFLASH_HW, a, rows, spd)
  head = next(i for i, x in enumerate(lines) if x.startswith("| L | A | strategy |"))
  table = lines[head + 2:lines.index("", head)]
  assert len(table) == len(rows)
  for r, line in zip(rows, table):
    assert line.startswith(f"| 0K | 8 | {r['strategy']} |"), line
    assert line.endswith(f"| {r['dominant']} | {r['mfu']:.0%} |"), line
  over = " / ".join(f"{v:.2f}x" for v in spd[0]["over_any"].values())
  assert any(f"({spd[0]['csbp']}) | {over} |" in x for x in lines)


def test_gdn_flops_equal_a_hand_count_and_the_projection_has_three_rows():
  """A one-layer GDN model (2 key heads of 8 repeated to 4 value heads of 8, conv 4) on one
  rank, L = 32, B = 16 (one segment, no chain): two scan steps, each a clean and a noisy
  call of 16 rows (one chunk of c = 16). Per call and value head, intra: k_beta k^T and
  q k^T 4 * 16^2 * 8 = 8192, the solves 16 * 15 * (8 + 8) = 3840, attn v_new
  2 * 16^2 * 8 = 4096; inter 6 * 16 * 8 * 8 = 6144. Conv: 64 rows x 2 * 64 channels x 4.
  Projections: 64 rows x 2 * 32 * (32 + 96 + 8)."""
  from bdlm_jax.analysis.cost_model import gdn, hybrid
  m = _model(d_model=32, n_layers=1, layer_pattern="gdn", gdn_key_heads=2, gdn_value_heads=4,
             gdn_key_dim=8, gdn_value_dim=8)
  layer = gdn.chain_layer(m, make_plan(SINGLE_DEVICE, 32, 16, 1))
  calls = 4 * 4  # (2 steps x clean and noisy) x 4 value heads
  assert (layer.intra, layer.inter) == (calls * (8192 + 3840 + 4096), calls * 6144)
  assert (layer.transfer, layer.apply) == (0, 0)
  assert layer.conv == 64 * 2 * 64 * 4
  assert layer.projection == 64 * 2 * 32 * (32 + 96 + 8)
  rows = hybrid.hybrid_rows(setting.Hardware(nodes=1, gpus_per_node=2), {"tiny": m},
                            seq_len=128, block_size=16)
  assert [(r["strategy"], r["gdn_transport"]) for r in rows] == list(hybrid.VARIANTS)
  assert all(r["gdn_s"] > 0 and r["gdn_bytes_per_step"] > 0 for r in rows)


# Hand-worked values of the seed's head-parallel GDN ("ulysses") and of the DFlash2
# projection, on sizes small enough to follow: every figure below is written out from the
# definitions in the modules' docstrings, not read back from their helpers.
def _tiny_gdn():
  """One GDN layer of width 32: 2 key heads of K = 8, 4 value heads of V = 8, conv 4, bf16."""
  return _model(d_model=32, n_layers=1, layer_pattern="gdn", gdn_key_heads=2,
                gdn_value_heads=4, gdn_key_dim=8, gdn_value_dim=8, gdn_conv=4,
                compute_dtype="bfloat16")


def test_gdn_ulysses_bytes_flops_and_seconds_equal_a_hand_count():
  """csbp_ring, L = 128, B = 16, P = 2: each rank holds 4 corrupted blocks (64 rows) and a
  64-row zigzag shard of the clean stream. Per layer and forward pass, a rank puts into the
  seed's all-to-alls (bf16 activations, f32 states):
    in     its 64 clean rows' q, k (2 x 2 x 8), v, z (2 x 4 x 8), b, a (2 x 4): 104 values
           a row, 64 * 104 * 2 = 13312 bytes;
    out    their outputs [Hv V], 64 * 32 * 2 = 4096 bytes;
    states its 4 blocks' boundary states [4, 8, 8] f32 (1024 bytes) and 3 conv rows of the
           64 pre-conv channels (3 * 64 * 2 = 384 bytes): 4 * 1408 = 5632 bytes.
  A step sends (P-1)/P of them in the forward, the remat's rerun and the backward.
  FLOPs: the full-length recurrence, 128 rows in 2 chunks of 64, on Hv/P = 2 heads; each
  block's 16 rows (one chunk) on all 4 heads from its boundary state; the conv over 128 / 2
  clean rows and the 64 block rows, of 64 channels x 4 taps."""
  from bdlm_jax.analysis.cost_model import gdn
  from bdlm_jax.analysis.cost_model.setting import GB
  m, a = _tiny_gdn(), Assumptions()
  work = plan_work("csbp_ring", 128, 16, 2)
  plan = work.plan
  assert (plan.rows_per_rank, plan.n_noisy) == (128, 64)
  sends = (64 * (2 * 2 * 8 + 2 * 4 * 8 + 2 * 4) * 2, 64 * 4 * 8 * 2,
           4 * (4 * 8 * 8 * 4 + (4 - 1) * 64 * 2))
  assert sends == (13312, 4096, 5632)
  assert gdn.ulysses_bytes(m, plan) == sends
  assert gdn.gdn_wire_bytes(m, plan, gdn.ULYSSES, reruns=1) == 1 * 3 * sum(sends) / 2 == 34560
  # Delta rule per value head and chunk of c rows: 4 c^2 K + c (c-1) (K + V) + 2 c^2 V in the
  # chunk, 6 c K V across chunks (gdn.py's module docstring).
  intra = lambda c: 4 * c * c * 8 + c * (c - 1) * 16 + 2 * c * c * 8
  inter = lambda c: 6 * c * 8 * 8
  assert (intra(64), intra(16)) == (261120, 16128)
  layer = gdn.ulysses_layer(m, plan)
  assert layer.intra == 2 * 2 * intra(64) + 4 * 4 * intra(16)  # (chunks x heads) + (blocks x heads)
  assert layer.inter == 2 * 2 * inter(64) + 4 * 4 * inter(16)
  assert (layer.transfer, layer.apply) == (0, 0)
  assert layer.conv == (128 // 2 + 4 * 16) * 2 * 64 * 4
  assert layer.projection == 128 * 2 * 32 * (2 * 2 * 8 + 4 * 8 + 4 * 8 + 4 + 4 + 4 * 8)
  # kept for the backward: every block's boundary state on its 2 heads, and its own 4 blocks'
  assert layer.state_bytes == (128 // 16 / 2 + 4) * 4 * 8 * 8 * 4
  # Seconds: three exposed all-to-alls a pass (each 1/2 of its bytes over NVLink), the conv
  # and rule at delta_rule_tflops; backward = forward + the forward's compute again, after the
  # remat's rerun of the forward.
  hw = setting.Hardware(nodes=1, gpus_per_node=2)
  comm = sum(hw.nvlink_alpha_us * 1e-6 + x / 2 / (hw.nvlink_gb_s * GB) for x in sends)
  busy = (layer.conv + layer.intra + layer.inter) / (hw.delta_rule_tflops * 1e12)
  fwd = busy + comm
  t = timing.step_time(m, work, hw, a, gdn.ULYSSES)
  assert t["gdn_s"] == pytest.approx(fwd + (fwd + busy + fwd), rel=1e-12)
  assert t["gdn_busy_s"] == pytest.approx(4 * busy, rel=1e-12)
  assert t["gdn_comm_bytes_per_step"] == 34560
  # head shards need P to divide both head counts
  with pytest.raises(ConfigError, match=r"parallel.seq=4 to divide the key and value heads"):
    gdn.ulysses_layer(m, make_plan("csbp_ring", 128, 16, 4))


# DFlash2 at toy size: L = 64, B = 4, A = 4 locality anchors, W = 8, P = 2, features offline.
TINY_DFLASH2 = dflash.Dflash2Recipe(
    _model(n_layers=4, qk_norm=True, tie_embeddings=False, compute_dtype="bfloat16"),
    dict(n_layers=2, d_ff=96, window=8, target_layers="1,3", features="offline"),
    block_size=4, anchors=4)
DFLASH2_HW = setting.Hardware(nodes=1, gpus_per_node=2, hbm_gb=80.0)


def _two_rank_ring(stay, steps, kv_hop, grad_hop):
  """timing.ring_s's rule written out for P = 2 (overlapped hops): each step waits for the
  other rank; the forward shifts K/V once, the backward also passes dK/dV after each step."""
  first = np.maximum(stay + steps[:, 0], stay.max() + kv_hop)
  if not grad_hop:
    return float((first + steps[:, 1]).max())
  return float(first.max() + grad_hop + steps[:, 1].max() + grad_hop)


def test_dflash2_project_equals_a_hand_count():
  """The locality rule: n = L - 1 = 63 candidates, stride B = 4 (coprime with 63), start
  (63 - 4 * 4) // 2 = 23: anchors 23, 27, 31, 35. Their windows [a - 7, a) cover context
  positions 16..34: 19 kept rows, all on rank 1 of the context zigzag (rank 0 holds 0..15 and
  48..63, rank 1 16..47), or the whole band where one rank holds the context. Per draft row,
  drafter linear FLOPs: 2 layers x (q, k, v, o 2 * 64 * (64 + 32 + 32 + 64) + MLP
  2 * 3 * 64 * 96) = 122880, forward, backward and the remat's rerun (x 4); LM head
  2 * 64 * 260 three times (forward, input gradient, the loss chunk's rerun: the head is
  frozen). Per kept context row: fc 2 * (2 * 64) * 64 twice (forward and weight gradient: the
  features are frozen), each layer's k/v 2 * 64 * 64 x 4. Draft rows a rank runs:
  A * B / P = 8 where the drafts are split, 16 on one GPU (none), and under the paper's
  baseline A * B = 16 on every rank: the draft work times max(1, CP/BP) = 2 (CP = 2, BP = 1). Features: 2 layers x 64 x 2 bytes a
  row, a GPU copying its 32-row context slot (64 where it holds the whole context), the node
  reading the 64 rows once a sequence (`none`: both GPUs' sequences a step). Attention: a
  draft row sees its block's 4 rows and, slot j, the 7 - j context rows before its anchor
  in its window (22 a block), 32 (or 64) context K/V rows travelling with their metadata
  where anything does."""
  from bdlm_jax.analysis.cost_model.setting import GB
  a, hw = Assumptions(), DFLASH2_HW
  rows = dflash.dflash2_project(hw, a, recipes={"tiny": TINY_DFLASH2}, seq_lens=(64,))
  at = {r["strategy"]: r for r in rows}
  assert set(at) == {"none", "cp_allgather", "cp_ring", "bp", "csbp_allgather", "csbp_ring",
                     "cp_replicated_drafts"}
  np.testing.assert_array_equal(locality_run(64, 4, 4), [23, 27, 31, 35])
  matmul = hw.matmul_tflops * 1e12
  per_draft_row = 2 * (2 * 64 * (64 + 32 + 32 + 64) + 2 * 3 * 64 * 96) * 4 + 3 * 2 * 64 * 260
  per_context_row = 2 * 2 * (2 * 64) * 64 + 2 * (2 * 64 * 64) * 4
  draft_rows = dict(none=16, cp_allgather=8, cp_ring=8, bp=8, csbp_allgather=8, csbp_ring=8,
                    cp_replicated_drafts=8 * max(1, 2 // 1))
  context_slot = dict(none=64, bp=64)
  pair = 4 * 64 / (hw.attention_tflops * 1e12)  # QK^T and PV over 4 heads of 16
  f = a.attention_bwd_factor
  kv = lambda rows: rows * 2 * 2 * 16 * a.compute_bytes + rows * a.meta_bytes_per_row
  grad = lambda rows: rows * 2 * 2 * 16 * a.kv_grad_bytes
  hop = lambda nbytes: hw.nvlink_alpha_us * 1e-6 + nbytes / (hw.nvlink_gb_s * GB)

  def attention(s):
    """(forward + backward) seconds of one drafter layer on s's transport."""
    own, ctx = 4 * draft_rows[s], 22 * draft_rows[s] // 4  # pairs of a rank's draft rows
    if s in ("none", "bp"):  # nothing travels: the backward 2.5 x the forward
      return (1 + f) * (own + ctx) * pair
    # Drafts split: rank 0 holds draft blocks 0 and 3, rank 1 blocks 1 and 2 (dual-end pairs;
    # cp_*'s zigzag of the 16 draft rows in 4-row chunks is the same); every kept context key
    # is on rank 1. The ring's step 0 reads a rank's own K/V, step 1 the other's.
    if s in ("cp_ring", "cp_allgather"):  # the 8 draft rows' K/V travel too: nothing stays
      travel_rows, stay = 32 + 8, np.zeros(2)
      steps = np.array([[own, ctx], [own + ctx, 0]]) * pair
    else:  # csbp_*, and the paper's baseline (all 16 draft rows on each rank): context only
      travel_rows, stay = 32, np.array([own, own]) * pair
      steps = np.array([[0, ctx], [ctx, 0]]) * pair
    kv_hop, grad_hop = hop(kv(travel_rows)), hop(grad(travel_rows))
    if s.endswith("allgather"):  # one exposed hop each way on 2 ranks
      busy = (stay + steps.sum(axis=1)).max()
      return busy + kv_hop + f * busy + kv_hop + grad_hop
    return (_two_rank_ring(stay, steps, kv_hop, 0.0)
            + _two_rank_ring(f * stay, f * steps, kv_hop, grad_hop))

  hand = {}
  for s, r in at.items():
    linear = (draft_rows[s] * per_draft_row + 19 * per_context_row) / matmul
    assert r["drafter_linear_s"] == pytest.approx(linear, rel=1e-12), s
    assert (r["target_linear_s"], r["target_attention_s"]) == (0, 0), s  # features offline
    assert r["drafter_attention_s"] == pytest.approx(2 * attention(s), rel=1e-12), s
    copy = context_slot.get(s, 32) * 2 * 64 * 2 / (hw.host_gb_s * GB)
    # the node reads one sequence a step, or under `none` (a sequence per GPU) two
    read = (2 if s == "none" else 1) * 64 * 2 * 64 * 2 / (hw.disk_gb_s * GB)
    assert (r["feature_copy_s"], r["feature_read_s"]) == (pytest.approx(copy, rel=1e-12),
                                                          pytest.approx(read, rel=1e-12)), s
    compute = linear + 2 * attention(s)
    assert r["compute_s"] == pytest.approx(compute, rel=1e-12), s
    assert r["total_s"] == pytest.approx(max(compute + copy, read), rel=1e-12), s
    sequences = 2 if s == "none" else 1
    hand[s] = dict(seq_compute_s=compute / sequences,
                   seq_s=max(compute + copy, read) / sequences)
    assert r["seq_s"] == pytest.approx(hand[s]["seq_s"], rel=1e-12), s
  # The paper's baseline: the split layout's drafter linear FLOPs, its draft part doubled.
  paper, csbp = at[dflash.PAPER_BASELINE], at["csbp_ring"]
  assert (paper["drafter_linear_s"] - csbp["drafter_linear_s"]) * matmul == pytest.approx(
      8 * per_draft_row, rel=1e-9)
  # The ratio: the paper's baseline over the best fitting CSBP (the faster of csbp_ring and
  # csbp_allgather: here csbp_allgather, whose backward waits one dK/dV hop, not two).
  (c,) = dflash.paper_comparison(rows)
  assert c["oom"] == []
  for part, suffix in (("seq_s", ""), ("seq_compute_s", "_compute")):
    best = min(("csbp_ring", "csbp_allgather"), key=lambda s: hand[s][part])
    assert best == "csbp_allgather" and c[f"csbp{suffix}"]["strategy"] == best
    assert c[f"over_paper{suffix}"] == pytest.approx(
        hand["cp_replicated_drafts"][part] / hand[best][part], rel=1e-12)


def test_dflash2_under_the_seeds_settings_equals_a_hand_count():
  """The seed's settings (`dflash.SEED`) on the 2 GPUs: two data-parallel groups of one GPU,
  so CSBP holds a whole sequence on one GPU and nothing travels; no remat (each drafter
  layer's linear work 3 times, the frozen head's twice); each GPU's feature copy prefetched
  (the step is the longest of compute, copy and read), the node reading both groups'
  sequences a step; per sequence, the step over its 2 sequences. The paper's baseline runs on
  both GPUs, one sequence a step, every draft block on each. Pairs and rows as in
  `test_dflash2_project_equals_a_hand_count`."""
  from bdlm_jax.analysis.cost_model.setting import GB
  a, hw = Assumptions(), DFLASH2_HW
  rows = dflash.dflash2_seed_project(hw, a, recipes={"tiny": TINY_DFLASH2}, seq_lens=(64,))
  at = {r["strategy"]: r for r in rows}
  assert set(at) == {"csbp_ring", "csbp_allgather", dflash.PAPER_BASELINE, "bp"}
  matmul = hw.matmul_tflops * 1e12
  layers = 2 * (2 * 64 * (64 + 32 + 32 + 64) + 2 * 3 * 64 * 96)
  per_draft_row = layers * 3 + 2 * 2 * 64 * 260
  per_context_row = 2 * 2 * (2 * 64) * 64 + 2 * (2 * 64 * 64) * 3
  pair = 4 * 64 / (hw.attention_tflops * 1e12)
  row_bytes = 2 * 64 * 2
  for s in ("csbp_ring", "csbp_allgather"):
    r = at[s]
    linear = (16 * per_draft_row + 19 * per_context_row) / matmul
    compute = linear + 2 * (1 + a.attention_bwd_factor) * (4 * 16 + 22 * 4) * pair
    copy, read = 64 * row_bytes / (hw.host_gb_s * GB), 2 * 64 * row_bytes / (hw.disk_gb_s * GB)
    assert (r["sequence_gpus"], r["drafter_linear_s"]) == (1, pytest.approx(linear, rel=1e-12))
    assert r["compute_s"] == pytest.approx(compute, rel=1e-12), s
    assert r["total_s"] == pytest.approx(max(compute, copy, read), rel=1e-12), s
    assert r["seq_s"] == pytest.approx(max(compute, copy, read) / 2, rel=1e-12), s
    assert r["seq_compute_s"] == pytest.approx(compute / 2, rel=1e-12), s
  paper = at[dflash.PAPER_BASELINE]
  assert paper["sequence_gpus"] == 2 and paper["seq_s"] == paper["total_s"]
  assert paper["drafter_linear_s"] * matmul == pytest.approx(
      16 * per_draft_row + 19 * per_context_row, rel=1e-12)
  assert paper["total_s"] == pytest.approx(max(
      paper["compute_s"], 32 * row_bytes / (hw.host_gb_s * GB),
      64 * row_bytes / (hw.disk_gb_s * GB)), rel=1e-12)


@pytest.mark.parametrize("causal,pairs", [(False, 152), (True, 128)])
def test_a_dflash2_drafters_useful_flops_equal_a_hand_count(causal, pairs):
  """MFU's useful FLOPs of TINY_DFLASH2 at L = 64 (features offline: no target layer runs):
  the 16 draft rows through 2 layers (122,880 FLOPs a row, forward and two gradients), the
  19 context rows its windows reach through each layer's k/v (2 * 64 * 64 x 2 layers, three
  times) and fc (2 * 128 * 64, forward and weight gradient), the head over the draft rows
  (2 * 64 * 260, forward and input gradient), and the allowed pairs (152, or 128 with causal
  blocks: `test_dflash2_draft_pairs_equal_the_drafters_sliding_window_mask`) at 4 * 64 FLOPs
  a pair and layer, three times."""
  cfg = replace(dflash.recipe_config(TINY_DFLASH2, 64), drafter=dict(sliding_causal=causal))
  layers = 2 * (2 * 64 * (64 + 32 + 32 + 64) + 2 * 3 * 64 * 96)
  trained = 16 * layers + 19 * 2 * (2 * 64 * 64) + 4 * pairs * 64 * 2
  frozen = 16 * 2 * 64 * 260 + 19 * 2 * 128 * 64
  assert model_flops_per_step(cfg) == 3 * trained + 2 * frozen


def test_dflash2_draft_pairs_equal_the_drafters_sliding_window_mask():
  """Slot j of anchor a (position a + j) sees context positions >= a + j - (W-1)
  (`models.drafter.windowed_drafts`, `drafter.window`): with W = 8 and anchors 23..35 each
  block's 4 slots see 7, 6, 5 and 4 context rows and the block's 4 draft rows, 38 pairs;
  four blocks 152, where the cost model counts 4 * (16 + 28) = 176."""
  from bdlm_jax.models.drafter import windowed_drafts
  cfg = dflash.recipe_config(TINY_DFLASH2, 64)
  anchors = locality_run(64, 4, 4)
  slot = np.tile(np.arange(4), 4)
  draft = RowMeta(*(np.asarray(x, np.int32)[None] for x in (
      np.full(16, NOISY), np.repeat(anchors, 4), np.ones(16), np.repeat(anchors, 4) + slot,
      np.zeros(16))))
  context = RowMeta(*(np.asarray(x, np.int32)[None] for x in (
      np.full(64, CLEAN), np.arange(64), np.ones(64), np.arange(64), np.zeros(64))))
  keys = jax.tree.map(lambda x, y: np.concatenate([x, y], axis=1), draft, context)
  mask = np.asarray(allowed(windowed_drafts(draft, cfg.drafter.window), keys))
  assert mask.sum() == 4 * (4 * 4 + 7 + 6 + 5 + 4) == 152
  drafter, _ = dflash.dflash_works("none", cfg, 1)
  assert drafter.stay_pairs.sum() + drafter.travel_pairs.sum() == 152
  # Causal draft blocks (drafter.sliding_causal, the seed's default): slot j sees j + 1 of its
  # block's rows, 10 a block, not 16.
  causal = replace(cfg, drafter=dict(sliding_causal=True))
  mask = np.asarray(allowed(windowed_drafts(draft, 8, causal=True), keys))
  assert mask.sum() == 4 * (1 + 2 + 3 + 4 + 7 + 6 + 5 + 4) == 128
  drafter, _ = dflash.dflash_works("none", causal, 1)
  assert drafter.stay_pairs.sum() + drafter.travel_pairs.sum() == 128
