"""The loss in row chunks equals the loss over all rows, values and gradients."""

import functools

import jax
import numpy as np
import pytest

from bdlm_jax import ar_logits, init_params, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.analysis import hlo_stats

L = 96


def _cfg(logits_chunk, objective="bd3lm", strategy="none", **parallel):
  return replace(Config(), model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      head_dim=8, d_ff=64, logits_chunk=logits_chunk),
                 data=dict(seq_len=L), objective=dict(name=objective, block_size=4),
                 parallel=dict(strategy=strategy, **parallel), train=dict(batch_size=4))


def _value_and_grad(cfg, mesh=None):
  rng = np.random.default_rng(5)
  seg = np.sort(rng.integers(1, 3, (4, L)), axis=1)
  seg[:, -5:] = 0
  batch = make_batch(cfg, rng.integers(0, 250, (4, L)), seg, rng.random((4, L)) < 0.2)
  params = init_params(cfg, jax.random.key(3), mesh)
  fn = jax.value_and_grad(lambda p: loss_fn(p, batch, jax.random.key(4), cfg, mesh)[0])
  return jax.jit(fn)(params)


@functools.cache
def _unchunked(objective):
  return _value_and_grad(_cfg(0, objective))


# 7 does not divide the rows (a padded chunk): every objective; 1 and 32 on bd3lm
@pytest.mark.slow
@pytest.mark.parametrize("objective, chunk", [("bd3lm", 1), ("bd3lm", 7), ("bd3lm", 32),
                                              ("fast_dllm_v2", 7), ("ar", 7)])
def test_chunked_loss_equals_the_loss_over_all_rows(objective, chunk):
  loss, grads = _value_and_grad(_cfg(chunk, objective))
  ref_loss, ref_grads = _unchunked(objective)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.linalg.norm(g - ref) <= 1e-5 * np.linalg.norm(ref)


def test_chunked_loss_and_ar_logits_both_soft_cap_the_logits():
  """`model.logit_softcap` holds in the loss's head chunks as in `Transformer.logits`: the ar
  loss is the mean next-token NLL of `ar_logits`, with or without the cap."""
  tokens = np.random.default_rng(0).integers(0, 250, (4, L))

  def loss_and_nll(cap):
    cfg = replace(_cfg(7, "ar"), model=dict(logit_softcap=cap))
    params = init_params(cfg, jax.random.key(3))
    loss = loss_fn(params, make_batch(cfg, tokens), jax.random.key(4), cfg)[0]
    logp = np.asarray(jax.nn.log_softmax(ar_logits(params, cfg, tokens)[:, :-1]))
    return float(loss), -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

  (plain, plain_nll), (capped, capped_nll) = loss_and_nll(0.0), loss_and_nll(0.1)
  np.testing.assert_allclose([plain, capped], [plain_nll, capped_nll], rtol=1e-5)
  assert abs(capped - plain) > 1e-3  # init logits are ~0.1: a cap of 0.1 bends them


@pytest.mark.slow
def test_chunks_stay_on_their_rank_under_a_seq_strategy():
  cfg = _cfg(5, strategy="csbp_ring", seq=8)
  loss, grads = _value_and_grad(cfg, make_mesh(cfg))
  ref_loss, ref_grads = _value_and_grad(_cfg(0))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert np.linalg.norm(g - ref) <= 1e-5 * np.linalg.norm(ref)


def test_chunked_loss_never_holds_all_the_logits():
  """Compiled temp memory falls when the vocabulary is large and the chunk small."""
  def temp(chunk):
    cfg = replace(_cfg(chunk), model=dict(vocab_size=32768),
                  objective=dict(mask_token_id=32767))
    batch = make_batch(cfg, np.random.default_rng(0).integers(0, 250, (4, L)))
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    grad = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg)[0]))
    return grad.lower(params).compile().memory_analysis().temp_size_in_bytes
  full_logits = 4 * L * 32768 * 4  # f32 [S, noisy rows, vocab]
  assert temp(0) > full_logits > 2 * temp(8)


@pytest.mark.slow
def test_head_gradient_is_reduced_once_whatever_the_chunk_count():
  """Every device accumulates the head's gradient over its own chunks; the devices meet
  once. (A reduction inside the chunk loop would count once per chunk.)"""
  def all_reduce_bytes(chunk):
    cfg = _cfg(chunk, strategy="csbp_ring", seq=8)
    mesh = make_mesh(cfg)
    batch = make_batch(cfg, np.random.default_rng(0).integers(0, 250, (4, L)))
    params = init_params(cfg, jax.random.key(0), mesh)
    grad = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]))
    return hlo_stats.collective_bytes(grad.lower(params).compile())["all-reduce"]
  assert all_reduce_bytes(1) == all_reduce_bytes(0)


@pytest.mark.parametrize("objective", ["bd3lm", "dflash"])
def test_tracing_the_loss_resolves_the_layout_plan_once(objective, monkeypatch):
  """The config is resolved at the edge (`bdlm_jax.spec`); attention, the objective's hidden
  states and the loss close over that one plan instead of looking it up again."""
  from bdlm_jax.parallel import registry
  from tests.objectives.test_dflash import _cfg as dflash_cfg
  cfg = (dflash_cfg("csbp_ring", seq=2) if objective == "dflash"
         else _cfg(0, strategy="csbp_ring", seq=2))
  mesh = make_mesh(cfg)
  tokens = np.random.default_rng(1).integers(0, 250, (cfg.train.batch_size, cfg.data.seq_len))
  batch, params = make_batch(cfg, tokens), init_params(cfg, jax.random.key(0), mesh)
  calls = []
  # Every `plan_for`, whoever imported it, looks the plan up here.
  cached = registry._cached_plan
  monkeypatch.setattr(registry, "_cached_plan", lambda *key: calls.append(key) or cached(*key))
  jax.make_jaxpr(lambda p, b: loss_fn(p, b, jax.random.key(0), cfg, mesh))(params, batch)
  assert len(calls) == 1
