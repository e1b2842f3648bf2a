"""Gated DeltaNet hybrids under every strategy give the single-device loss and gradients
(parallel/recurrence.py): the segments' affine state maps, the chain of entry states over the
`seq` axis, the conv halos, and the fetched copies where a rank's blocks are not on its own
clean rows. Block counts that divide 2P (each rank's blocks on its own clean chunks) and
that do not (greedy blocks, whole-stream zigzag). Row 0 of every batch is packed documents
(`packed_segments`), so each case also checks that the restarts at document starts (clean
stream, blocks, chain hops, halos, fetched copies) are the single-device ones; the
single-device packed rows equal each document's own run (tests/models/test_gdn.py)."""

import functools

import jax
import numpy as np
import pytest

from bdlm_jax import init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.analysis.step_report import lower_train_step, step_report
from bdlm_jax.parallel.recurrence import stream_program
from bdlm_jax.parallel.registry import get_strategy, make_plan, strategy_names
from tests.parallel.test_strategies import _loss_and_grads as strategies_loss_and_grads
from tests.parallel.test_strategies import assert_close

MODEL = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
             d_ff=32, layer_pattern="gdn,global", gdn_key_heads=1, gdn_value_heads=2,
             gdn_key_dim=4, gdn_value_dim=4, attention_gate=True, partial_rotary_factor=0.5,
             attention_chunk=16)
# (seq_len, block_size, seq): N = 2P blocks on seq4 (local segments, a chain of 8), N = 6
# on seq4 (greedy blocks on 3-row zigzag chunks: fetched copies, halos across two segments;
# cp refuses it), N = P on seq8 (cp runs a whole block a rank)
CASES = {"N=2P": (32, 4, 4), "P<N<2P": (24, 4, 4), "seq8": (48, 6, 8)}


def _cfg(strategy, seq_len, block_size, seq, objective="bd3lm"):
  return replace(Config(), model=MODEL, data=dict(seq_len=seq_len),
                 objective=dict(name=objective, block_size=block_size, mask_token_id=63),
                 parallel=dict(strategy=strategy, seq=seq), train=dict(batch_size=2))


def packed_segments(seq_len):
  """Row 0 packed (docs/gdn.md): documents that start mid-block (5, 9, 17, L - 3), at a block
  start that is a rank's chunk start on N=2P (8, a 1-token document), and run across ranks;
  padding between documents (16, a chunk start) and none at the end. Row 1 one document,
  padded at the end."""
  seg = np.ones((2, seq_len), np.int64)
  bounds = [0, 5, 8, 9, 16, 17, seq_len - 3, seq_len]
  for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
    seg[0, a:b] = d + 1
  seg[0, 16:17] = 0  # padding between documents
  seg[1, -5:] = 0
  return seg


def _loss_and_grads(cfg):
  """Packed documents in row 0, one document in row 1 (`packed_segments`): each document's
  state and conv restart at its start, in the clean stream, the blocks and the chain."""
  rng = np.random.default_rng(cfg.data.seq_len)
  tokens = rng.integers(0, 60, (2, cfg.data.seq_len))
  mesh = make_mesh(cfg) if cfg.parallel.strategy != "none" else None
  return strategies_loss_and_grads(cfg, mesh, (tokens, packed_segments(cfg.data.seq_len)),
                                   seed=3)


@functools.cache
def _reference(seq_len, block_size, objective="bd3lm"):
  return _loss_and_grads(_cfg("none", seq_len, block_size, 1, objective))


# Beyond N = 2P, for time: greedy blocks where csbp and cp fetch copies, and cp's N = P.
FURTHER_CASES = {"P<N<2P": ("cp_ring", "csbp_ring"), "seq8": ("cp_ring",)}
# csbp_ring at N = 2P runs in test_gdn_hybrid_under_offload_period_equals_single_device (the
# same layout and batch; remat none on csbp_ring: its P<N<2P case).
ELSEWHERE = {("csbp_ring", "N=2P")}


def _laid_out(strategy, case):
  """Whether `strategy` lays out `case` at all (e.g. cp_ring_balanced needs whole blocks in
  each of 2P chunks; cp_replicated_drafts a drafter)."""
  try:
    make_plan(strategy, *CASES[case])
    return True
  except ConfigError:
    return False


def _one_per_layout():
  """A strategy per layout builder: the streams depend on the layout, not on how attention
  moves K/V (cp_allgather runs cp_ring's, csbp_allgather csbp_ring's)."""
  seen = {get_strategy(name).plan: name for name in strategy_names(splits_sequences=True)}
  return list(seen.values())  # the last registered of each: the rings


@pytest.mark.slow
@pytest.mark.parametrize("strategy, case", [
    (s, c) for s in _one_per_layout() for c in CASES
    if _laid_out(s, c) and (c == "N=2P" or s in FURTHER_CASES[c]) and (s, c) not in ELSEWHERE])
def test_gdn_hybrid_loss_and_grads_equal_single_device(strategy, case):
  seq_len, block_size, seq = CASES[case]
  try:  # cp's zigzag of the whole stream needs L / P rows to be whole blocks
    stream_program(make_plan(strategy, seq_len, block_size, seq), 3)
  except ConfigError:
    with pytest.raises(ConfigError, match="cannot run Gated DeltaNet"):
      _cfg(strategy, seq_len, block_size, seq)
    return
  cfg = _cfg(strategy, seq_len, block_size, seq)
  assert_close(*_loss_and_grads(cfg), *_reference(seq_len, block_size))


@pytest.mark.slow
def test_gdn_hybrid_under_offload_period_equals_single_device():
  """remat=offload_period, the Gated DeltaNet and the global layer one scan step: the
  backward re-runs the step (chain and ring), then each layer as under `full`."""
  cfg = replace(_cfg("csbp_ring", *CASES["N=2P"]), model=dict(remat="offload_period"))
  assert_close(*_loss_and_grads(cfg), *_reference(*CASES["N=2P"][:2]))


@pytest.mark.slow
def test_gdn_hybrid_autoregressive_under_context_parallelism():
  cfg = _cfg("cp_ring", 32, 4, 4, objective="ar")
  assert_close(*_loss_and_grads(cfg), *_reference(32, 4, "ar"))


def test_csbp_blocks_that_divide_2p_need_no_copies_and_chain_every_segment():
  program = stream_program(make_plan("csbp_ring", 256, 8, 8), 3)
  assert program.fetch.shape[1] == 0  # every block's state is on its own rank
  assert len(program.chain) == 2 * 8 - 1  # the zigzag's 16 segments, one hop each
  bp = stream_program(make_plan("bp", 256, 8, 8), 3)
  assert not bp.chain and not bp.shares_tails  # replicated prefixes start from zeros


def test_whole_stream_zigzag_fetches_one_copy_a_rank():
  program = stream_program(make_plan("cp_ring", 256, 8, 8), 3)
  assert program.fetch.shape[1] == 1
  # rank r's corrupted chunk r is the clean chunk that rank P - 1 - r holds
  assert (program.fetch[:, 0, 0] == np.arange(8)[::-1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("strategy, seq_len, remat", [
    ("csbp_ring", 24, "none"),  # greedy blocks: chain, tails, fetched copies
    ("cp_ring", 32, "full"),  # the whole-stream zigzag's copy; the backward's re-run
    ("csbp_ring", 32, "offload_period"),  # the step's re-run, then the layer's own
])
def test_compiled_recurrence_collectives_are_the_programs(strategy, seq_len, remat):
  cfg = replace(_cfg(strategy, seq_len, 4, 4), model=dict(remat=remat))
  report = step_report(cfg)
  assert report.recurrence_check == pytest.approx(1.0, abs=0.01)  # 28 B of other gradients
  assert report.recurrence_collective_bytes["collective-permute"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["bp", "csbp_ring"])
def test_the_lowered_step_does_not_grow_with_the_stream(strategy):
  """A stream's steps are gathered and scanned, never traced one by one: at 1M tokens a rank
  runs thousands of steps (XLA:TPU was still compiling Qwen3.5-27B's 1M step under
  bp after an hour when each step's conv windows were slices of their own)."""
  def lines(seq_len):
    cfg = _cfg(strategy, seq_len, 4, 4)
    return lower_train_step(cfg, make_mesh(cfg)).as_text().count("\n")
  assert lines(512) == lines(128)  # 32 and 128 steps a stream


def _gdn_layer_loss(strategy, seq):
  """The loss alone (no backward, for time) of one Gated DeltaNet layer on `packed_segments`
  rows of 32 tokens in blocks of 4."""
  cfg = replace(_cfg(strategy, 32, 4, seq), model=dict(n_layers=1, layer_pattern="gdn"))
  mesh = make_mesh(cfg) if seq > 1 else None
  batch = make_batch(cfg, np.random.default_rng(0).integers(0, 60, (2, 32)), packed_segments(32))
  params = init_params(cfg, jax.random.key(3), mesh)
  return float(jax.jit(lambda p, b: loss_fn(p, b, jax.random.key(7), cfg, mesh)[0])(params, batch))


def test_conv_tails_from_another_rank_carry_their_document_ids():
  """cp_ring on 4 ranks, clean chunks of 8 rows: row 0's document starting at 8, a rank's
  first clean row, reads nothing of the tail gathered from the rank before it, and row 1's
  document, running on across ranks, reads its tail (the fast tier's check of what the
  slow loss-and-gradient cases above cover)."""
  assert _gdn_layer_loss("cp_ring", 4) == pytest.approx(_gdn_layer_loss("none", 1), rel=1e-5)
