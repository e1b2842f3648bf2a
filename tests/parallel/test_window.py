"""Local (sliding-window) layers under every strategy (docs/local_and_moe.md).

Loss and gradients equal one device for windows smaller than, equal to and larger than the
block, and wider than a rank's share L/P; the windowed exchange brings every key a window
reaches; on a local layer csbp moves bytes that do not grow with L.
"""

import functools

import numpy as np
import pytest

from bdlm_jax import make_mesh
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import RowMeta, allowed, windowed
from bdlm_jax.kernels.tiles import plan_row_meta
from bdlm_jax.parallel.layout import PAD
from bdlm_jax.parallel.registry import make_plan, plan_for
from bdlm_jax.analysis.probe import attention_layer_costs
from bdlm_jax.parallel.strategies import window_transport
from bdlm_jax.parallel.window import exchange_plan
from tests.parallel import test_strategies

L = 96  # on 8 ranks: L/P = 12 rows of each stream per rank
WINDOWS = {"W<B": (4, 3), "W=B": (4, 4), "W>B": (4, 9), "W>L/P": (4, 20)}  # (B, W)


def _cfg(strategy, block_size, window, **parallel):
  """Three layers, local-global-local: one scanned period and an unrolled remainder."""
  cfg = test_strategies._cfg(strategy, block_size, **parallel)
  return replace(cfg, model=dict(n_layers=3, layer_pattern="local,global",
                                 sliding_window=window, rope_local_theta=500.0))


@functools.cache
def _one_device(block_size, window):
  return test_strategies._loss_and_grads(_cfg("none", block_size, window), None)


def _assert_matches_one_device(cfg, mesh):
  reference = _one_device(cfg.objective.block_size, cfg.model.sliding_window)
  test_strategies.assert_close(*test_strategies._loss_and_grads(cfg, mesh), *reference)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,case", [("csbp_ring", case) for case in WINDOWS]
                         + [("cp_ring", "W<B"), ("cp_ring", "W>L/P")])
def test_local_layers_equal_one_device_for_every_window(strategy, case):
  cfg = _cfg(strategy, *WINDOWS[case], seq=8)
  _assert_matches_one_device(cfg, make_mesh(cfg))


# (The all-gather transports' local layers: tests/objectives/test_diffusiongemma.py.)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["bp"])
def test_local_layers_equal_one_device_under_the_other_strategies(strategy):
  cfg = _cfg(strategy, *WINDOWS["W>B"], seq=8)
  _assert_matches_one_device(cfg, make_mesh(cfg))


@pytest.mark.slow
def test_local_layers_equal_one_device_on_a_composed_mesh():
  """csbp_allgather with remat=offload_input: the backward re-runs each global layer's
  all-gather and each local layer's windowed exchange."""
  cfg = replace(_cfg("csbp_allgather", *WINDOWS["W<B"], data=2, fsdp=2, seq=2),
                model=dict(remat="offload_input"))
  assert window_transport(plan_for(cfg), cfg.model.sliding_window) == "exchange"
  _assert_matches_one_device(cfg, make_mesh(cfg))


@pytest.mark.slow
def test_local_layers_take_their_window_and_rope_base():
  """Run through the scanned period and the unrolled remainder: with W = L and one RoPE base
  the pattern is the all-global model; a short window or another local base changes it."""
  run = lambda **model: test_strategies._loss_and_grads(
      replace(_cfg("none", 4, L), model=model), None)
  glob = run(layer_pattern="global")
  full_window = run(rope_local_theta=0.0)
  test_strategies.assert_close(*full_window, *glob)
  assert abs(run(rope_local_theta=0.0, sliding_window=3)[0] - glob[0]) > 1e-3
  assert abs(run()[0] - glob[0]) > 1e-3  # rope_local_theta=500


def _window_rule(q, k, window, block_size):
  """docs/local_and_moe.md, pair by pair: a noisy query of block b sees clean keys at
  [bB - (W-1), bB); a clean query at p sees clean keys with p - pos(k) < W."""
  if q["stream"] == 0:
    return k["stream"] == 0 or k["pos"] >= q["block"] * block_size - (window - 1)
  return q["pos"] - k["pos"] < window


@pytest.mark.parametrize("block_size,window", [(4, 1), (4, 3), (4, 6), (2, 9)])
def test_windowed_metadata_applies_the_section_11_rules(block_size, window):
  meta = plan_row_meta(make_plan("none", 16, block_size, 1))
  row = lambda i: {f: int(getattr(meta, f)[0, i]) for f in RowMeta._fields}
  got = np.asarray(allowed(windowed(meta, window, block_size), meta))[0]
  glob = np.asarray(allowed(meta, meta))[0]
  for i in range(glob.shape[0]):
    for j in range(glob.shape[1]):
      assert got[i, j] == (glob[i, j] and _window_rule(row(i), row(j), window, block_size))


@pytest.mark.parametrize("strategy,seq_len,block_size,window", [
    ("csbp_ring", 64, 4, 3), ("csbp_ring", 64, 8, 5), ("csbp_allgather", 96, 4, 13),
    ("cp_ring", 64, 4, 6), ("cp_ring_balanced", 64, 4, 7), ("csbp_ring", 40, 4, 2)])
def test_the_exchange_brings_every_key_a_window_reaches(strategy, seq_len, block_size, window):
  """For each rank, every key row some query may attend to is local or received."""
  plan = make_plan(strategy, seq_len, block_size, 4)
  exchange = exchange_plan(plan, window)
  meta = plan_row_meta(plan)
  rank_meta = lambda r: RowMeta(*(x[r:r + 1] for x in meta))
  travel = plan.rows[:, plan.n_stay:]
  for dst in range(plan.num_ranks):
    have = set(plan.rows[dst][plan.rows[dst] != PAD].tolist())
    for d, send, valid in zip(exchange.distances, exchange.send, exchange.valid):
      src = (dst - d) % plan.num_ranks
      have |= set(travel[src][send[src][valid[src]]].tolist())
    q = windowed(rank_meta(dst), window, block_size)
    for src in range(plan.num_ranks):
      reached = np.asarray(allowed(q, rank_meta(src)))[0].any(axis=0)
      assert set(plan.rows[src][reached].tolist()) <= have, (dst, src)


@pytest.mark.slow
def test_csbp_local_layer_traffic_does_not_grow_with_the_sequence():
  """Fixed W and blocks per rank (B grows with L): csbp's windowed exchange moves the same
  bytes at every L, while its global ring grows with L."""
  local, ring = [], []
  for seq_len in (128, 256, 512):
    block = seq_len // 16  # 16 blocks over 4 ranks
    args = ("csbp_ring", seq_len, 4, block)
    assert window_transport(make_plan(*args[:1], seq_len, block, 4), 8) == "exchange"
    local.append(attention_layer_costs(*args, window=8)["total_collective_bytes"])
    ring.append(attention_layer_costs(*args)["total_collective_bytes"])
  assert local[0] > 0 and local == [local[0]] * 3, local
  assert ring[1] > 1.9 * ring[0] and ring[2] > 1.9 * ring[1], ring
  assert local[2] < ring[2] / 10


@pytest.mark.parametrize("strategy,seq_len,block_size,window,noisy", [
    ("none", 64, 4, 3, True), ("none", 64, 8, 20, True), ("csbp_ring", 64, 4, 6, True),
    ("cp_ring", 64, 1, 5, False)])
def test_attention_work_of_a_local_layer_counts_its_allowed_pairs(strategy, seq_len,
                                                                 block_size, window, noisy):
  """What MFU counts for a local layer: the pairs of the windowed mask, rank by rank."""
  plan = make_plan(strategy, seq_len, block_size, 1 if strategy == "none" else 4, noisy)
  meta = plan_row_meta(plan)
  rank = lambda r: RowMeta(*(x[r:r + 1] for x in meta))
  for r in range(plan.num_ranks):
    q = windowed(rank(r), window, block_size)
    pairs = sum(int(np.asarray(allowed(q, rank(src))).sum()) for src in range(plan.num_ranks))
    assert plan.attention_work(window)[r] == pairs
