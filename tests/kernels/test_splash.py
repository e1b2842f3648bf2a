"""The splash attention (jax's Splash kernels, interpret mode on CPU) against the xla oracle.

The mask is rewritten into per-query key intervals over sorted keys (kernels/splash.py): the
rewrite is checked pair by pair against `allowed`, then the kernels against the oracle on the
shapes of tests/kernels/test_pallas.py, every strategy's kernel calls, and whole steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import loss_fn, make_batch, make_mesh
from bdlm_jax.analysis import targets
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import get_kernel, splash
from bdlm_jax.kernels.mask import NOISY, NOISY_CAUSAL, RowMeta, allowed
from tests.models import test_gemma4
from tests.objectives import test_dflash, test_dflash2, test_diffusiongemma
from tests.kernels.test_pallas import (assert_matches_xla, inputs, random_meta, stack_calls,
                                       strategy_calls)
from tests.parallel.test_strategies import _cfg, _loss_and_grads, _reference, assert_close


def interval_mask(q_meta: RowMeta, k_meta: RowMeta) -> np.ndarray:
  """bool [Rq, Rk] (key rows in their own order) of what the two Splash calls let through:
  the clean interval within the query's document, or the noisy interval."""
  keys = splash.sort_keys(k_meta)
  (c_lo, c_hi), (n_lo, n_hi) = (tuple(np.asarray(x)[:, None] for x in pair)
                                for pair in splash.key_intervals(q_meta, keys))
  index = np.arange(keys.order.shape[0])[None]
  q_seg = np.asarray(q_meta.seg)[:, None]
  k_seg = np.asarray(k_meta.seg)[np.asarray(keys.order)][None]
  sorted_mask = (((index >= c_lo) & (index < c_hi) & (q_seg == k_seg) & (q_seg > 0))
                 | ((index >= n_lo) & (index < n_hi)))
  return sorted_mask[:, np.argsort(np.asarray(keys.order))]


@pytest.mark.parametrize("seed", range(4))
def test_key_intervals_let_through_exactly_the_allowed_pairs(seed):
  """Documents, padding, windows (also ones cutting into a noisy query's block), causal
  draft queries, several documents per block, blocks of one position."""
  rng = np.random.default_rng(seed)
  q_meta, k_meta = random_meta(rng, 2, 90, n_blocks=12), random_meta(rng, 2, 130, n_blocks=12)
  if seed % 2:
    q_meta = q_meta._replace(stream=jnp.where(q_meta.stream == NOISY, NOISY_CAUSAL,
                                              q_meta.stream))
  for s in range(2):
    q, k = (jax.tree.map(lambda x: x[s], m) for m in (q_meta, k_meta))
    want = np.asarray(allowed(q, k))
    assert want.any() and not want.all()
    np.testing.assert_array_equal(interval_mask(q, k), want)


def test_packed_documents_windows_padding_and_gqa_match_xla_in_f32():
  q, k, v, rng = inputs(1, hkv=2)
  q_meta, k_meta = random_meta(rng, 2, 40), random_meta(rng, 2, 56)
  q_meta = q_meta._replace(seg=q_meta.seg.at[1, :9].set(0))  # padding queries: attend nothing
  out, _ = assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5, impl=splash)
  np.testing.assert_array_equal(np.asarray(out)[1, :9], 0.0)


def test_every_strategy_local_and_ring_step_mask_matches_xla():
  q_meta, k_meta = stack_calls(strategy_calls())
  q, k, v, _ = inputs(3, s=q_meta.seg.shape[0], rq=q_meta.seg.shape[1],
                      rk=k_meta.seg.shape[1], hq=2, hkv=1)
  assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5, impl=splash)


@pytest.mark.slow
def test_keys_past_one_call_run_in_chunks_and_causal_drafts_match_xla(monkeypatch):
  """300 keys in calls of 128 (the packed interval's limit, lowered), tiles of 384 rows."""
  monkeypatch.setattr(splash, "MAX_KEYS", 128)
  q, k, v, rng = inputs(5, rq=300, rk=300, hkv=2)
  q_meta, k_meta = random_meta(rng, 2, 300, n_blocks=40), random_meta(rng, 2, 300, n_blocks=40)
  q_meta = q_meta._replace(stream=jnp.where(q_meta.stream == NOISY, NOISY_CAUSAL, q_meta.stream))
  assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5, impl=splash)


def test_bf16_matches_f32_oracle_within_2e_2():
  q, k, v, rng = inputs(7, hkv=2, dtype=jnp.bfloat16)
  assert_matches_xla(q, k, v, random_meta(rng, 2, 40), random_meta(rng, 2, 56), tol=2e-2,
                     impl=splash)


@pytest.mark.slow
@pytest.mark.parametrize("objective, strategy", [
    ("bd3lm", "cp_allgather"), ("fast_dllm_v2", "csbp_ring"), ("ar", "cp_ring")])
def test_loss_and_grads_with_splash_equal_one_device_with_xla(objective, strategy):
  """Splash inside each transport on 2 ranks (ring steps, all-gathers) gives the
  single-device xla loss and gradients (tests/parallel/test_strategies.py's batch)."""
  block = 1 if objective == "ar" else 4
  cfg = replace(_cfg(strategy, block, objective, seq=2), model=dict(attention_impl="splash"))
  assert_close(*_loss_and_grads(cfg, make_mesh(cfg)), *_reference(block, objective))


@pytest.mark.slow
def test_diffusiongemma_with_splash_equals_one_device_with_xla():
  """Packed conversations, a local (windowed) and a global layer, self-conditioning."""
  dg = test_diffusiongemma
  cfg = replace(dg._cfg("csbp_ring", seq=2), model=dict(attention_impl="splash"))
  assert_close(*test_gemma4.loss_and_grads(cfg, make_mesh(cfg), dg._packed_batch()),
               *dg._one_device())


@pytest.mark.slow
def test_dflash2_drafter_with_splash_equals_one_device_with_xla():
  """Causal sliding-window draft slots (NOISY_CAUSAL), pruned context, the draft queries
  rotating past the context (the query ring)."""
  d2 = test_dflash2
  cfg = replace(d2._cfg2("csbp_ring", seq=2, draft_transport="query"),
                model=dict(attention_impl="splash"))
  mesh = make_mesh(cfg)
  params, _, ref_loss, _, ref_grads = d2._single_device()
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg, mesh), has_aux=True))
  (loss, _), grads = step(params, make_batch(cfg, *d2._logical_batch()))
  assert_close(float(loss), jax.tree.map(np.asarray, grads["drafter"]), ref_loss,
               ref_grads["drafter"])


@pytest.mark.slow
def test_dflash_drafter_with_splash_under_replicated_drafts_equals_one_device_with_xla():
  """Every draft block on every rank, the context all-gathered, documents and padding."""
  d1 = test_dflash
  cfg = replace(d1._cfg("cp_replicated_drafts", seq=2), model=dict(attention_impl="splash"))
  loss, grads = d1._loss_and_grads(cfg, make_mesh(cfg))
  ref_loss, ref_grads = d1._reference()
  assert_close(loss, grads["drafter"], ref_loss, ref_grads["drafter"])


def test_attention_impl_splash_is_the_splash_module_and_refused_for_gpu(monkeypatch):
  assert get_kernel("splash") is splash
  q, k, v, rng = inputs(0, hq=6, hkv=4)
  meta_q, meta_k = random_meta(rng, 2, 40), random_meta(rng, 2, 56)
  with pytest.raises(ConfigError, match="multiple of K/V heads"):
    splash.attend_fwd(q, k, v, meta_q, meta_k)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ConfigError, match="TPU .*interpreted here.*pallas"):
    splash.attend_fwd(q, k, v, meta_q, meta_k)
  cfg = replace(Config(), model=dict(attention_impl="splash"))
  with pytest.raises(ConfigError, match="TPU .*Mosaic.*pallas"):
    targets.check(cfg, "gpu")
  targets.check(cfg, "tpu")
  with pytest.raises(ConfigError, match="attention_impl=splash"):
    targets.check(replace(cfg, model=dict(attention_impl="pallas")), "tpu")


def test_kernels_lower_through_mosaic_for_tpu():
  """Lowered for TPU, both directions are Mosaic custom calls (no interpreter): bf16, D=128,
  GQA 4, 2048 keys, metadata traced."""
  x = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, k, lse = x(1, 1024, 8, 128), x(1, 2048, 2, 128), x(1, 1024, 8, dt=jnp.float32)
  qm, km = (RowMeta(*[x(1, r, dt=jnp.int32)] * len(RowMeta._fields)) for r in (1024, 2048))
  for f, args in [(splash.attend_fwd, (q, k, k, qm, km)),
                  (splash.attend_bwd, (q, k, k, qm, km, q, lse, q, lse))]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "splash" in text.lower()
