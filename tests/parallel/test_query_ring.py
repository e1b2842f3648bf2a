"""Query rotation (parallel/query_ring.py): the seed's byte formulas, which transport our rule
(`auto`) and the seed's (`seed`) pick, and the bytes at the Muse-Glimmer-30B shape. Its
exactness against one device is in tests/objectives/test_dflash*.py (and `seed`'s here), its
compiled bytes in tests/analysis/test_step_report.py."""

import pathlib

import jax
import numpy as np
import pytest

from bdlm_jax import make_mesh
from bdlm_jax.analysis import plan_mode
from bdlm_jax.analysis.step_report import (config_attention_traffic, draft_transport_choices,
                                           draft_transport_line)
from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace
from bdlm_jax.parallel import query_ring
from bdlm_jax.parallel.registry import plan_for
from bdlm_jax.parallel.strategies import draft_transport
from tests.objectives.test_dflash import _cfg, _loss_and_grads, _reference
from tests.parallel.test_strategies import assert_close


def test_hop_bytes_are_the_seeds_with_gradients_in_the_compute_dtype():
  """dflash_attention.py ~166-172: Q 4qs + 8q + 12 stat + 2 meta against K/V 6 (K elements) s
  (K and V forward, again backward, dK and dV)."""
  q, stat, s, meta, k = 1000, 30, 2, 7, 500
  seed = 4 * q * s + 8 * q + 12 * stat + 2 * meta
  assert query_ring.query_hop_bytes(q, stat, s, 4, meta) == seed
  assert query_ring.kv_hop_bytes(2 * k, s, s, 0) == 6 * k * s


@pytest.mark.parametrize("strategy,parallel,transport", [
    ("csbp_ring", dict(seq=8), "query"),  # 4 draft rows of 2 heads x 8 vs 8 context rows
    ("csbp_allgather", dict(seq=8), "query"),
    ("csbp_ring", dict(seq=2), "kv"),  # a ring of two keeps the K/V (the seed's latency rule)
    ("cp_replicated_drafts", dict(seq=4), "kv"),  # every draft block on every rank
    ("cp_ring", dict(seq=8), "kv"),  # the draft rows travel too: nothing to rotate
    ("bp", dict(seq=8), "kv")])  # nothing travels
def test_auto_rotates_the_queries_where_they_send_fewer_bytes(strategy, parallel, transport):
  cfg = _cfg(strategy, **parallel)
  assert draft_transport(cfg, plan_for(cfg)) == transport


def _muse(transport: str) -> Config:
  """The Muse-Glimmer-30B-DFlash2 drafter's attention (docs/dflash.md): 5 sliding-window
  layers (W 2048) of 32 / 8 heads x 128 in bf16, blocks of 16 at 512 anchors over one
  1,048,576-token sequence on 8 devices, features from disk (no target layers run)."""
  return replace(
      Config(),
      model=dict(d_model=256, n_layers=50, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=256,
                 compute_dtype="bfloat16"),
      drafter=dict(n_layers=5, window=2048, features="features", target_layers="1,13,25,37,49"),
      data=dict(seq_len=1 << 20),
      objective=dict(name="dflash", block_size=16, max_anchors=512, draft_loss="ce"),
      parallel=dict(strategy="csbp_ring", seq=8, draft_transport=transport),
      train=dict(batch_size=1, eval_every=0))


def test_at_the_muse_shape_the_queries_move_under_a_tenth_of_the_kv_rings_bytes():
  kv, query = (sum(config_attention_traffic(_muse(t)).values()) for t in ("kv", "query"))
  assert draft_transport(_muse("auto"), plan_for(_muse("auto"))) == "query"
  assert query <= 0.1 * kv
  assert (round(kv / 1e9, 2), round(query / 1e9, 2)) == (80.68, 2.36)


# The seed's rule by hand (dflash_attention.py ~125-189) on the tiny drafter of `_cfg`: 2 query
# heads and 1 K/V head of 8, f32 (s = 4), blocks of 4; q = rows x 16 query elements, stat =
# rows x 2, meta = 9 B an anchor, kv = the unpruned context slot's rows x 8 K elements.
def _seed_by_hand(p, rows, slot):
  q, stat, meta, kv, s = rows * 16, rows * 2, 9 * rows // 4, slot * 8, 4
  sent = dict(query=4 * q * s + 8 * q + 12 * stat + 2 * meta, kv=6 * kv * s)
  forward = (p + 1) * (4 * q + 8 * stat) + 2 * (q * s + meta)
  backward = (p + 1) * 4 * q + 8 * kv + 2 * (3 * q * s + 4 * stat + meta)
  return sent, dict(query=max(forward, backward), kv=12 * kv * s)


@pytest.mark.parametrize("strategy,seq,seq_len,anchors,rows,slot,sent,peaks,seed,auto", [
    # csbp (the seed's dual_end): 4 draft rows' queries outweigh 8 context rows' K/V by the
    # seed's count (f32 dQ), not by ours (K and V, f32 dK/dV, metadata)
    ("csbp_ring", 8, 64, 8, 4, 8, (1650, 1536), (4434, 3072), "kv", "query"),
    ("csbp_ring", 8, 128, 8, 4, 16, (1650, 3072), (4946, 6144), "query", "query"),
    # a dual_end ring of two keeps the K/V though both tests pass (ours: any ring of two)
    ("csbp_ring", 2, 256, 8, 16, 128, (6600, 24576), (17736, 49152), "kv", "kv"),
    # anchors not split equally (6 over 4 ranks): the K/V ring
    ("csbp_ring", 4, 512, 6, 8, 128, (3300, 24576), (13988, 49152), "kv", "query"),
    # every draft block on every rank (the seed's all_blocks): a ring of two may rotate
    ("cp_replicated_drafts", 2, 256, 8, 32, 128, (13200, 24576), (27280, 49152), "query", "kv"),
    # fewer bytes, but the query path's peak (9 f32 dQ partials) over the K/V ring's
    ("cp_replicated_drafts", 8, 640, 8, 32, 80, (13200, 15360), (36496, 30720), "kv", "query"),
    ("cp_ring", 4, 64, 8, 4, 0, None, None, "kv", "kv")])  # the drafts travel: nothing to pick
def test_the_seeds_rule_by_hand(strategy, seq, seq_len, anchors, rows, slot, sent, peaks, seed,
                                auto):
  cfg = replace(_cfg(strategy, seq=seq), data=dict(seq_len=seq_len),
                objective=dict(max_anchors=anchors))
  plan = plan_for(cfg)
  rule = lambda name: draft_transport(replace(cfg, parallel=dict(draft_transport=name)), plan)
  assert (rule("seed"), rule("auto")) == (seed, auto)
  if sent is None:
    return
  assert (plan.n_noisy, plan.rows_per_rank - plan.n_noisy) == (rows, slot)
  by_hand = _seed_by_hand(seq, rows, slot)
  assert by_hand == (dict(query=sent[0], kv=sent[1]), dict(query=peaks[0], kv=peaks[1]))
  assert query_ring.transport_bytes(cfg, plan, "seed") == by_hand[0]
  assert query_ring.seed_peaks(cfg, plan) == by_hand[1]


@pytest.mark.slow
def test_the_seeds_rule_runs_the_transport_it_picks():
  """`seed` only picks `kv` or `query`: here `kv` (ours would rotate the queries), and the loss
  and gradients are one device's."""
  cfg = _cfg("csbp_ring", seq=8, draft_transport="seed")
  assert draft_transport_choices(cfg)["compiled"] == "kv"
  loss, grads = _loss_and_grads(cfg, make_mesh(cfg))
  ref_loss, ref_grads = _reference()
  assert_close(loss, grads["drafter"], ref_loss, ref_grads["drafter"])
  assert all(np.linalg.norm(g) > 0 for g in jax.tree.leaves(grads["drafter"]))


MUSE_CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "dflash2_muse_1m.py"
MUSE_BYTES = {  # a hop of a drafter layer, one sequence: (ours, the seed's count), bytes
    "csbp_ring": ((67_534_848, 218_529_792), (67_503_232, 1_610_612_736)),
    "cp_replicated_drafts": ((540_278_784, 218_529_792), (540_025_856, 1_610_612_736))}


@pytest.mark.parametrize("strategy,auto,seed", [("csbp_ring", "query", "query"),
                                               ("cp_replicated_drafts", "kv", "query")])
def test_the_muse_recipe_under_both_rules(strategy, auto, seed):
  """configs/dflash2_muse_1m.py on one axis of 8 (no compile): under csbp_ring both rules
  rotate the queries; under cp_replicated_drafts (all 8,192 draft rows on every rank) the
  seed's count, against the unpruned 131,072-row context slot, rotates 540 MB of queries
  instead of 1,611 MB of K/V, where the ring actually sends the 13,312 kept rows' 219 MB:
  ours keeps the K/V."""
  cfg = load_config(str(MUSE_CONFIG), [f"parallel.strategy={strategy}", "parallel.seq=8",
                                       "parallel.data=1", "train.batch_size=1"])
  c = draft_transport_choices(cfg)
  ours, seeds = MUSE_BYTES[strategy]
  assert (c["auto"], c["seed"], c["compiled"]) == (auto, seed, auto)
  assert (c["bytes"]["query"], c["bytes"]["kv"]) == ours
  assert (c["seed_bytes"]["query"], c["seed_bytes"]["kv"]) == seeds
  assert c["seed_peaks"]["query"] < c["seed_peaks"]["kv"] == 12 * 131072 * 8 * 128 * 2
  # mode=plan prints the line of each strategy that has a draft transport to pick
  assert plan_mode.draft_transport_lines(cfg, [strategy, "cp_ring"]) == [
      "Draft transports:", draft_transport_line(cfg), ""]
  print(draft_transport_line(cfg))
