"""Layout plans hold every row where docs/strategies.md says, balanced, or fail clearly."""

import numpy as np
import pytest

from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel.layout import PAD, assign_blocks, zigzag
from bdlm_jax.parallel.registry import get_strategy, make_plan, strategy_names

SHARDED = ("cp_ring", "cp_allgather", "cp_ring_balanced", "csbp_ring", "csbp_allgather")
# (L, B, P): blocks N a multiple of 2P (pairs), N >= 2P not a multiple and P <= N < 2P (greedy).
SHAPES = [(64, 4, 8), (1024, 16, 8), (128, 16, 4), (96, 4, 8), (288, 16, 8), (48, 4, 8),
          (64, 16, 2)]


def _plan(strategy, L, B, P):
  """The plan, or a skip where cp_ring_balanced's whole-block chunks do not fit (L, B, P)."""
  if strategy == "cp_ring_balanced" and L % (2 * P * B):
    with pytest.raises(ConfigError, match="chunks of whole blocks"):
      make_plan(strategy, L, B, P)
    pytest.skip("L is not a multiple of 2*P*B")
  return make_plan(strategy, L, B, P)


def _valid(rows):
  return rows[rows != PAD]


@pytest.mark.parametrize("L, B, P", SHAPES)
@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_plans_hold_every_logical_row_exactly_once(strategy, L, B, P):
  plan = _plan(strategy, L, B, P)
  np.testing.assert_array_equal(np.sort(_valid(plan.rows)), np.arange(2 * L))


def test_single_device_plan_is_the_logical_order():
  np.testing.assert_array_equal(make_plan("none", 64, 4, 1).rows, np.arange(128)[None])


@pytest.mark.parametrize("L, B, P", SHAPES)
def test_every_rank_keeps_noisy_rows_in_its_noisy_slot(L, B, P):
  for strategy in SHARDED + ("bp",):
    if strategy == "cp_ring_balanced" and L % (2 * P * B):
      continue  # whole-block chunks do not fit: rejected (test above)
    plan = make_plan(strategy, L, B, P)
    noisy, clean = plan.rows[:, :plan.n_noisy], plan.rows[:, plan.n_noisy:]
    assert np.all(_valid(noisy) < L) and np.all(_valid(clean) >= L), strategy


@pytest.mark.parametrize("L, B, P", SHAPES)
def test_bp_holds_noisy_rows_once_and_replicates_the_clean_prefix(L, B, P):
  plan = make_plan("bp", L, B, P)
  noisy = plan.rows[:, :plan.n_noisy]
  np.testing.assert_array_equal(np.sort(_valid(noisy)), np.arange(L))
  for rank_rows in plan.rows:
    last_block = _valid(rank_rows[:plan.n_noisy]).max() // B
    # Exactly the clean blocks its last noisy block may see: 0 .. last_block - 1.
    np.testing.assert_array_equal(_valid(rank_rows[plan.n_noisy:]), L + np.arange(last_block * B))


@pytest.mark.parametrize("L, B, P", SHAPES)
def test_every_strategy_counts_the_same_logical_rows_once(L, B, P):
  """What the router statistics pool: each noisy row and each clean row before the last block
  (the ones `bp` holds) once, whatever the layout; an autoregressive plan's whole clean stream."""
  for strategy in strategy_names(needs_drafter=False):  # drafters': the test below
    record = get_strategy(strategy)
    for noisy_stream, want in ((True, np.arange(2 * L - B)), (False, L + np.arange(L))):
      if (not noisy_stream and record.needs_noisy_stream
          or noisy_stream and strategy == "cp_ring_balanced" and L % (2 * P * B)):
        continue  # the strategy refuses this stream or shape (tests above)
      plan = make_plan(strategy, L, B, P if record.splits_sequences else 1, noisy_stream)
      counted = plan.rows.reshape(-1)[plan.counted_rows]
      np.testing.assert_array_equal(np.sort(counted), want, err_msg=f"{strategy} {noisy_stream}")


def test_every_drafter_strategy_counts_the_same_logical_rows_once():
  """Every draft row and every context row once, whichever rank holds it (or copies of it)."""
  L, B, P, A = 64, 4, 4, 8
  for strategy in strategy_names():
    record = get_strategy(strategy)
    plan = make_plan(strategy, L, B, P if record.splits_sequences else 1, draft_blocks=A)
    counted = plan.rows.reshape(-1)[plan.counted_rows]
    np.testing.assert_array_equal(np.sort(counted), np.arange(A * B + L), err_msg=strategy)


def test_cp_replicated_drafts_gives_every_rank_every_draft_block_and_a_context_shard():
  """The paper's CP baseline: drafts replicated (each scored on its first copy only), the
  context zigzagged as csbp's, only context K/V travel; no plan without draft blocks."""
  L, B, P, A = 64, 4, 4, 8
  plan = make_plan("cp_replicated_drafts", L, B, P, draft_blocks=A)
  n = A * B
  assert plan.travel == "clean" and plan.n_noisy == n
  np.testing.assert_array_equal(plan.rows[:, :n], np.tile(np.arange(n), (P, 1)))
  csbp = make_plan("csbp_ring", L, B, P, draft_blocks=A)
  np.testing.assert_array_equal(plan.rows[:, n:], csbp.rows[:, csbp.n_noisy:])
  first = plan.first_copies.reshape(P, -1)
  assert first[0].all() and not first[1:, :n].any() and first[:, n:].all()
  with pytest.raises(ConfigError, match="'cp_replicated_drafts' .* needs a drafter objective"):
    make_plan("cp_replicated_drafts", L, B, P)
  with pytest.raises(ConfigError, match="'cp_replicated_drafts' .* cannot run the 'bd3lm'"):
    replace(Config(), data=dict(seq_len=L), parallel=dict(strategy="cp_replicated_drafts",
                                                          seq=P))


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
  np.testing.assert_array_equal(
      zigzag(16, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
  np.testing.assert_array_equal(zigzag(8, 2, offset=100), [[100, 101, 106, 107],
                                                           [102, 103, 104, 105]])


def test_zigzag_balances_causal_work():
  # Causal work of row i is i + 1: every rank gets the same total.
  work = (zigzag(256, 8) + 1).sum(axis=1)
  assert np.all(work == work[0])


def test_cp_puts_noisy_chunk_r_and_clean_chunk_2p_minus_1_minus_r_on_rank_r():
  L, P = 64, 4
  plan = make_plan("cp_ring", L, 4, P)
  np.testing.assert_array_equal(plan.rows, zigzag(2 * L, P))
  assert plan.n_noisy == L // P and plan.travel == "all"


def test_csbp_clean_slot_is_one_zigzag_shard_of_the_clean_stream():
  L, P = 256, 8
  plan = make_plan("csbp_ring", L, 16, P)
  np.testing.assert_array_equal(plan.rows[:, plan.n_noisy:], zigzag(L, P, offset=L))
  assert plan.travel == "clean"


@pytest.mark.parametrize("n_blocks, num_ranks", [(16, 8), (32, 8), (64, 8), (8, 4), (24, 4)])
def test_blocks_go_in_dual_end_pairs_split_contiguously(n_blocks, num_ranks):
  owned = assign_blocks(n_blocks, num_ranks)
  for rank, blocks in enumerate(owned):
    assert {n_blocks - 1 - b for b in blocks} == set(blocks), (rank, blocks)
  pair_ids = [sorted({min(b, n_blocks - 1 - b) for b in blocks}) for blocks in owned]
  np.testing.assert_array_equal(np.concatenate(pair_ids), np.arange((n_blocks + 1) // 2))


def test_fewer_than_two_blocks_per_rank_are_placed_greedily_largest_first():
  # Costs b + 1 = 6, 5, 4, 3 take one rank each; 3 and 2 (blocks 1, 0) top up the lightest.
  assert assign_blocks(6, 4) == [[5], [4], [0, 3], [1, 2]]
  for n_blocks, num_ranks in [(8, 8), (9, 8), (15, 8), (5, 4)]:
    owned = assign_blocks(n_blocks, num_ranks)
    assert all(owned), owned
    assert sorted(b for o in owned for b in o) == list(range(n_blocks))


def test_fewer_blocks_than_ranks_is_a_config_error():
  with pytest.raises(ConfigError, match=r"2 blocks cannot be split over parallel.seq=4"):
    make_plan("csbp_ring", 32, 16, 4)
  with pytest.raises(ConfigError, match="blocks cannot be split"):
    make_plan("bp", 32, 16, 4)


def test_seq_len_not_a_multiple_of_block_size_is_a_config_error():
  with pytest.raises(ConfigError, match=r"data.seq_len=100 is not a multiple of "
                                        r"objective.block_size=16"):
    replace(Config(), data=dict(seq_len=100), objective=dict(block_size=16))
  with pytest.raises(ConfigError, match="not a multiple of objective.block_size"):
    make_plan("csbp_ring", 100, 16, 2)


@pytest.mark.parametrize("strategy, L, B, P, constraint", [
    ("csbp_ring", 40, 4, 8, r"divisible by 2\*seq=16"),  # clean zigzag: 2P chunks of L rows
    ("cp_ring", 36, 4, 8, "divisible by parallel.seq"),  # 2L rows in 2P chunks
])
def test_seq_len_not_divisible_by_the_ranks_is_a_config_error_naming_the_constraint(
    strategy, L, B, P, constraint):
  with pytest.raises(ConfigError, match=constraint):
    make_plan(strategy, L, B, P)


@pytest.mark.parametrize("L, B, P", [
    (64, 4, 8), (256, 16, 8), (1024, 16, 8), (1024, 32, 8), (2048, 64, 8), (128, 16, 4),
    (512, 8, 4), (2048, 16, 16),
    (288, 16, 8),  # N = 18 blocks: 9 pairs over 8 ranks
    (384, 16, 8),  # N = 24: 12 pairs over 8 ranks
    (160, 16, 4),  # N = 10: 5 pairs over 4 ranks
])
def test_csbp_attention_work_is_balanced_within_10_percent(L, B, P):
  assert L // B >= 2 * P
  work = make_plan("csbp_ring", L, B, P).attention_work()
  assert work.max() / work.mean() < 1.1, work


def test_bp_holds_over_4x_the_rows_of_csbp_at_8_ranks():
  L, B, P = 1024, 16, 8
  bp, csbp = make_plan("bp", L, B, P), make_plan("csbp_ring", L, B, P)
  ratio = bp.rows_per_rank / csbp.rows_per_rank  # 1136 / 256 = 4.44
  assert ratio > 4, ratio
  assert bp.valid_rows().mean() / csbp.valid_rows().mean() > 3.5  # 912 / 256 = 3.56


def _pairs_per_ring_step(plan) -> np.ndarray:
  """int [P steps, P ranks]: allowed pairs of rank r's queries with the K/V that visit it at
  ring step s (rank (r - s) % P's rows), from the mask rules on the plan's rows."""
  L, B = plan.seq_len, plan.block_size
  rows = plan.rows
  valid = rows != PAD
  noisy, block = rows < L, (rows % L) // B
  q_noisy, q_block = noisy[:, :, None, None], block[:, :, None, None]
  k_noisy, k_block = noisy[None, None], block[None, None]
  rule = np.where(q_noisy, np.where(k_noisy, k_block == q_block, k_block < q_block),
                  ~k_noisy & (k_block <= q_block))
  pairs = (rule & valid[:, :, None, None] & valid[None, None]).sum(axis=(1, 3))  # [Pq, Pk]
  p = plan.num_ranks
  return np.array([[pairs[r, (r - s) % p] for r in range(p)] for s in range(p)])


@pytest.mark.parametrize("L, B, P", [(256, 4, 8), (1024, 16, 8), (128, 16, 4)])
def test_balanced_cp_ring_gives_every_rank_equal_work_at_every_ring_step(L, B, P):
  steps = _pairs_per_ring_step(make_plan("cp_ring_balanced", L, B, P))
  assert np.all(steps[1:] == steps[1:, :1])  # every visiting step: the same work on each rank
  unbalanced = _pairs_per_ring_step(make_plan("cp_ring", L, B, P))
  assert np.all(steps.sum(0) == unbalanced.sum(0)[0])  # the same total per rank as cp_ring
  assert np.any(unbalanced[1:].max(1) > unbalanced[1:].min(1))  # which waits at some step
