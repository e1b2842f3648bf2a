"""BD3-LM objective: noise levels, corruption, the SUBS loss, and the AR labels."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import NOISY
from bdlm_jax.objectives import bd3lm


def _cfg(**objective):
  return replace(Config(), data=dict(seq_len=64), objective=dict(block_size=8, **objective))


def test_antithetic_t_covers_the_clip_range_evenly():
  t = np.sort(np.asarray(bd3lm.sample_t(jax.random.key(0), 4, 16, 0.1, 0.9)).ravel())
  gaps = np.diff(t)
  np.testing.assert_allclose(gaps, 0.8 / 64, rtol=1e-4)  # one point per (1/(S*N)) stratum
  assert 0.1 <= t[0] < 0.1 + 0.8 / 64 and 0.9 - 0.8 / 64 <= t[-1] < 0.9


def test_realised_mask_rate_tracks_t():
  cfg = replace(Config(), data=dict(seq_len=4096), objective=dict(block_size=1024))
  tokens = np.random.default_rng(0).integers(0, 250, (8, 4096))
  batch = jax.tree.map(jnp.asarray, make_batch(cfg, tokens))
  _, _, masked, weight = bd3lm.corrupt(jax.random.key(1), batch, cfg)
  noisy = np.asarray(batch.stream) == NOISY
  t_row = 1.0 / np.asarray(weight)
  for s in range(8):
    for b in range(4):
      rows = noisy[s] & (np.asarray(batch.block[s]) == b)
      rate, t = np.asarray(masked[s])[rows].mean(), t_row[s][rows][0]
      assert abs(rate - t) < 4 * math.sqrt(t * (1 - t) / 1024) + 1e-3, (s, b, rate, t)


def test_protected_padding_and_clean_rows_are_never_masked():
  cfg = _cfg(eps_min=1.0, eps_max=1.0)  # t = 1: every maskable token is masked
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 250, (3, 64))
  seg = np.ones((3, 64), np.int32)
  seg[:, 50:] = 0
  protected = rng.random((3, 64)) < 0.3
  batch = jax.tree.map(jnp.asarray, make_batch(cfg, tokens, seg, protected))
  _, _, masked, _ = bd3lm.corrupt(jax.random.key(3), batch, cfg)
  masked = np.asarray(masked)
  noisy = np.asarray(batch.stream) == NOISY
  expect = noisy & ~np.concatenate([protected, protected], 1) & (np.asarray(batch.seg) > 0)
  np.testing.assert_array_equal(masked, expect)


def test_corruption_is_the_same_under_every_layout():
  tokens = np.random.default_rng(4).integers(0, 250, (2, 64))
  masked_positions = {}
  for strategy, seq in (("none", 1), ("cp_ring", 8), ("bp", 8), ("csbp_ring", 8)):
    cfg = replace(_cfg(), parallel=dict(strategy=strategy, seq=seq))
    batch = jax.tree.map(jnp.asarray, make_batch(cfg, tokens))
    _, _, masked, _ = bd3lm.corrupt(jax.random.key(5), batch, cfg)
    rows = np.asarray(masked) & (np.asarray(batch.stream) == NOISY)
    masked_positions[strategy] = {(s, int(p)) for s, p in zip(*np.nonzero(rows))
                                  for p in [np.asarray(batch.pos)[s, p]]}
  assert len(set(map(frozenset, masked_positions.values()))) == 1
  assert masked_positions["none"]  # something was masked


def test_subs_loss_on_a_hand_made_example():
  # vocab 4, [MASK] = 3. Row 0: masked, label 0, t = 0.5 (w = 2). Row 1: masked, label 2,
  # t = 0.25 (w = 4). Row 2: not masked (contributes 0). Row 3: no label.
  logits = jnp.array([[[1.0, 2.0, 0.0, 5.0], [0.0, 0.0, 3.0, 9.0], [4.0, 0, 0, 0],
                       [1.0, 1, 1, 1]]])
  labels = jnp.array([[0, 2, 1, -1]])
  masked = jnp.array([[True, True, False, True]])
  weight = jnp.array([[2.0, 4.0, 8.0, 1.0]])
  ce0 = -math.log(math.e / (math.e + math.e**2 + 1))  # [MASK] logit 5.0 is excluded
  ce1 = -math.log(math.e**3 / (1 + 1 + math.e**3))
  got = bd3lm.subs_loss(logits, labels, masked, weight, mask_token_id=3)
  assert float(got) == pytest.approx(2 * ce0 + 4 * ce1, rel=1e-6)


def test_loss_is_normalised_by_valid_tokens_not_masked_ones():
  """At t = 0.5 about half of the 80 valid (unprotected) tokens are masked. A final norm of
  scale 0 makes every logit 0, so each masked token's SUBS CE is log(V - 1) ([MASK] dropped):
  the loss is masked / valid * log(259), half what a masked-count normalisation gives."""
  from bdlm_jax import init_params, loss_fn
  cfg = replace(_cfg(eps_min=0.5, eps_max=0.5, loss_weight="unit"),
                model=dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64))
  rng = np.random.default_rng(6)
  tokens = rng.integers(0, 250, (2, 64))
  protected = np.zeros((2, 64), bool)
  protected[:, :24] = True
  batch = make_batch(cfg, tokens, protected=protected)
  params = init_params(cfg, jax.random.key(0))
  params["final_norm"]["scale"] = jnp.zeros_like(params["final_norm"]["scale"])
  loss, metrics = loss_fn(params, batch, jax.random.key(1), cfg)
  valid, masked = int(metrics["valid_tokens"]), int(metrics["masked_tokens"])
  assert valid == 2 * 40 and 0.3 * valid < masked < 0.7 * valid
  assert float(loss) == pytest.approx(masked / valid * math.log(259), rel=1e-5)


def test_ar_rows_predict_the_next_token_of_the_same_document():
  cfg = replace(Config(), data=dict(seq_len=8), objective=dict(name="ar"))
  tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
  seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0]])
  protected = np.array([[0, 0, 0, 0, 1, 0, 0, 0]], bool)
  batch = make_batch(cfg, tokens, seg, protected)
  np.testing.assert_array_equal(batch.labels[0], [6, 7, -1, -1, 10, -1, -1, -1])


def test_mask_token_in_the_data_is_rejected():
  from bdlm_jax import ConfigError
  cfg = _cfg()
  tokens = np.zeros((1, 64), np.int64)
  tokens[0, 5] = cfg.objective.mask_token_id
  with pytest.raises(ConfigError, match="reserved for \\[MASK\\]"):
    make_batch(cfg, tokens)
