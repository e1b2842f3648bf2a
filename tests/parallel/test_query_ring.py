"""Query rotation (parallel/query_ring.py): the seed's byte rule, which transport `auto`
picks, and the bytes at the Muse-Glimmer-30B shape. Its exactness against one device is in
tests/objectives/test_dflash*.py, its compiled bytes in tests/analysis/test_step_report.py."""

import pytest

from bdlm_jax.analysis.step_report import config_attention_traffic
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.parallel import query_ring
from bdlm_jax.parallel.registry import plan_for
from bdlm_jax.parallel.strategies import draft_transport
from tests.objectives.test_dflash import _cfg


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
      model=dict(d_model=256, n_layers=51, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=256,
                 compute_dtype="bfloat16"),
      drafter=dict(n_layers=5, window=2048, features="features", target_layers="2,14,26,38,50"),
      data=dict(seq_len=1 << 20),
      objective=dict(name="dflash", block_size=16, max_anchors=512, draft_loss="ce"),
      parallel=dict(strategy="csbp_ring", seq=8, draft_transport=transport),
      train=dict(batch_size=1, eval_every=0))


def test_at_the_muse_shape_the_queries_move_under_a_tenth_of_the_kv_rings_bytes():
  kv, query = (sum(config_attention_traffic(_muse(t)).values()) for t in ("kv", "query"))
  assert draft_transport(_muse("auto"), plan_for(_muse("auto"))) == "query"
  assert query <= 0.1 * kv
  assert (round(kv / 1e9, 2), round(query / 1e9, 2)) == (80.68, 2.36)
