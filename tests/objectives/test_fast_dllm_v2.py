"""Fast-dLLM v2: shifted labels, complementary masks, and layout independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import init_params, loss_fn, make_batch, make_mesh, sample
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.objectives import fast_dllm_v2
from bdlm_jax.params import merge
from bdlm_jax.parallel.strategies import make_attend

MASK = 259


def _cfg(seq_len, block_size, strategy="none", parallel=None, **objective):
  return replace(
      Config(),
      model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                 attention_chunk=32),
      data=dict(seq_len=seq_len),
      objective=dict(name="fast_dllm_v2", block_size=block_size, **objective),
      parallel=dict(dict(strategy=strategy, seq=8 if strategy != "none" else 1),
                    **(parallel or {})),
      train=dict(batch_size=4))


def _packed_sft_batch(seq_len):
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, 250, (4, seq_len))
  seg = np.sort(rng.integers(1, 4, (4, seq_len)), axis=1)
  seg[:, -5:] = 0
  protected = rng.random((4, seq_len)) < 0.3
  return tokens, seg, protected


def test_complementary_masks_supervise_each_token_exactly_once():
  cfg = _cfg(32, 4)
  tokens, seg, protected = _packed_sft_batch(32)
  batch = make_batch(cfg, tokens, seg, protected)
  batch2, inputs, scored, _ = jax.jit(
      lambda k: fast_dllm_v2.corrupt(k, batch, cfg))(jax.random.key(3))
  inputs = np.asarray(inputs).reshape(4, 2, 64)[..., :32]  # noisy rows = positions (none)
  scored = np.asarray(scored).reshape(4, 2, 64)[..., :32]
  masked = inputs == MASK
  supervised = fast_dllm_v2.supervised_positions(seg, protected)
  assert (masked.sum(1) == supervised).all()  # m and ~m partition the maskable tokens
  assert not masked[np.broadcast_to(protected[:, None], masked.shape)].any()
  has_label = np.asarray(batch.labels)[:, :32] >= 0
  assert (scored.sum(1) == has_label).all()  # each label scored in exactly one copy
  # The row scored in a copy is the one whose *next* input is masked in that copy.
  assert (scored[..., :-1] == masked[..., 1:] & has_label[:, None, :-1]).all()
  assert np.asarray(batch2.labels).shape == (8, 64)


def test_logit_at_i_is_scored_against_token_i_plus_1():
  cfg = _cfg(8, 4, eps_min=1.0, eps_max=1.0)  # t = 1: copy 1 masks every maskable token
  tokens = np.array([[10, 11, 12, 13, 14, 15, 16, 17]])
  seg = np.array([[1, 1, 1, 1, 1, 1, 0, 0]])
  protected = np.array([[1, 1, 0, 0, 0, 0, 0, 0]], bool)  # a 2-token prompt
  batch = make_batch(cfg, tokens, seg, protected)
  # Row 1 (prompt) predicts 12; 14, first of block 1, is predicted by clean row 3 (row 8 + 3).
  np.testing.assert_array_equal(batch.labels[0, :8], [-1, 12, 13, -1, 15, -1, -1, -1])
  np.testing.assert_array_equal(batch.labels[0, 8:], [-1, -1, -1, 14, -1, -1, -1, -1])
  key = jax.random.key(0)
  _, inputs, scored, _ = fast_dllm_v2.corrupt(key, batch, cfg)
  np.testing.assert_array_equal(inputs[0, :8], [10, 11, MASK, MASK, MASK, MASK, 16, 17])
  np.testing.assert_array_equal(inputs[1], batch.tokens[0])  # the complement masks nothing
  assert not np.asarray(scored[1]).any()

  params = init_params(cfg, jax.random.key(1))
  loss, metrics = jax.jit(lambda p, b: loss_fn(p, b, key, cfg))(params, batch)

  @jax.jit
  def copy1_logits(params, batch):
    model = merge(cfg, params)
    return model.logits(model(inputs[:1], batch.pos, batch.meta, make_attend(cfg)))

  logp = jax.nn.log_softmax(copy1_logits(params, batch)[0].at[:, MASK].set(-jnp.inf))
  manual = -np.mean([logp[row, tokens[0, pos + 1]] for row, pos in ((1, 1), (2, 2), (8 + 3, 3),
                                                                     (4, 4))])
  np.testing.assert_allclose(loss, manual, rtol=1e-6)
  assert int(metrics["valid_tokens"]) == 4


def _loss_and_grads(cfg, mesh, batch_arrays):
  batch = make_batch(cfg, *batch_arrays)
  params = init_params(cfg, jax.random.key(0), mesh)
  step = jax.jit(jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k, cfg, mesh), has_aux=True))
  (loss, _), grads = step(params, batch, jax.random.key(7))
  return float(loss), jax.tree.map(np.asarray, grads)


def test_a_blocks_first_token_is_scored_on_the_clean_row_that_sampling_uses():
  """x_4, first of block 1, is scored on clean row 3, which sees block 0 clean whatever the
  corruption, as the sampler's finished block does: its greedy pick for x_4 is that row's."""
  cfg = _cfg(8, 4)
  tokens = np.array([[10, 11, 12, 13, 14, 15, 16, 17]])
  batch = make_batch(cfg, tokens)
  assert (batch.labels[0, 3], batch.labels[0, 8 + 3]) == (-1, 14)
  params = init_params(cfg, jax.random.key(1))
  model_logits = jax.jit(lambda p, inputs, b: merge(cfg, p).logits(
      merge(cfg, p)(inputs, b.pos, b.meta, make_attend(cfg))))
  row3 = np.asarray(model_logits(params, batch.tokens, batch))[0, 8 + 3]  # nothing masked
  for seed in range(3):
    batch2, inputs, _, _ = fast_dllm_v2.corrupt(jax.random.key(seed), batch, cfg)
    assert (np.asarray(inputs)[:, :4] == MASK).any()  # block 0 is partly masked
    np.testing.assert_allclose(model_logits(params, inputs, batch2)[:, 8 + 3],
                               np.stack([row3] * 2), rtol=1e-5, atol=1e-6)
  first = sample(params, cfg, tokens[0, :4], jax.random.key(0), max_new_tokens=4, eos_id=-1,
                 strategy="confidence", temperature=0.0)[0]
  assert first == np.argmax(np.where(np.arange(row3.size) == MASK, -np.inf, row3))


SEED_FORM = dict(boundary_row="noisy", keep_mask_logit=True, antithetic=False)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, parallel, form", [
    ("cp_allgather", {}, {}), ("cp_ring", {}, {}), ("bp", {}, {}), ("csbp_allgather", {}, {}),
    ("csbp_ring", {}, {}), ("csbp_ring", dict(data=2, seq=4), {}),
    ("cp_ring", dict(data=2, seq=4), {}), ("csbp_ring", {}, SEED_FORM)],
    ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else x)
def test_loss_and_grads_equal_single_device(strategy, parallel, form):
  """bp replicates the clean prefix: a block's first token, labelled on a clean row, must
  still count once. With data=2 each data rank doubles its own sequences (the two
  complementary copies must stay on the rank that holds the sequence). The seed's form
  (labels on the noisy copies only, independent t) is exact too."""
  arrays = _packed_sft_batch(64)
  ref_loss, ref_grads = _loss_and_grads(_cfg(64, 4, **form), None, arrays)
  cfg = _cfg(64, 4, strategy, parallel, **form)
  loss, grads = _loss_and_grads(cfg, make_mesh(cfg), arrays)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.linalg.norm(g - ref) / np.linalg.norm(ref) < 1e-5
