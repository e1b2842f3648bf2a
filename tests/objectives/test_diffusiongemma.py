"""The diffusiongemma objective (docs/diffusiongemma.md): its loss equals a canvas-by-canvas
reference built on `canvas_logits` (which equals transformers' DiffusionGemma), its
corruption touches only supervised canvas tokens, with uniform tokens, and every strategy
gives the one-device loss and gradients, self-conditioning and router losses on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import ConfigError, ar_logits, canvas_logits, loss_fn, make_batch, make_mesh
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import NOISY
from bdlm_jax.objectives import diffusiongemma
from tests.models import test_gemma4
from tests.parallel import test_strategies

L, B = 64, 4  # 16 canvases over 8 ranks
# Gemma 4's layers (tests/models/test_gemma4.py), one local and one global, self-conditioning
MODEL = dict(test_gemma4.GEMMA4, n_layers=2, last_layer_global=False, self_conditioning=True)


def _cfg(strategy="none", p=1.0, **parallel):
  return replace(test_strategies._cfg(strategy, B), model=MODEL, data=dict(seq_len=L),
                 objective=dict(name=diffusiongemma.NAME, self_condition_p=p,
                                encoder_loss_weight=0.7),
                 parallel=parallel)


def _sft_batch(prompt=12, pad=5):
  """Four sequences: a prompt of `prompt` tokens (protected), a response, `pad` padding."""
  tokens = np.random.default_rng(11).integers(0, 250, (4, L))
  seg = np.ones((4, L), np.int32)
  seg[:, L - pad:] = 0
  protected = np.zeros((4, L), bool)
  protected[:, :prompt] = True
  return tokens, seg, protected


def _token_nll(logits, labels):
  logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  return -np.take_along_axis(np.asarray(logp), labels[..., None], axis=-1)[..., 0]


def test_loss_equals_a_canvas_by_canvas_reference():
  """On one device: each supervised canvas scored from `canvas_logits` over its clean prefix
  (self-conditioned on a first pass's logits where the sequence draws it), averaged per
  block, per sequence and over sequences; plus the weighted next-token loss of `ar_logits`
  over the pairs of each document. Canvases 3 and 4 hold the response, padding follows."""
  cfg = _cfg(p=0.5)
  tokens, seg, protected = _sft_batch(prompt=12, pad=L - 20)
  batch = make_batch(cfg, tokens, seg, protected)
  params = test_gemma4.drawn_params(cfg, None)
  key = jax.random.key(3)
  _, (inputs, conditioned), _, _ = diffusiongemma.corrupt(key, batch, cfg)
  conditioned = np.asarray(conditioned)
  assert conditioned.any() and not conditioned.all()  # both kinds of sequence
  canvas_in = np.asarray(inputs)[:, :L]  # strategy none: noisy row p is position p
  run = jax.jit(lambda p, prompt, canvas, *sc: canvas_logits(p, cfg, prompt, canvas, *sc))
  decoder = []
  for s in range(4):
    blocks = []
    for b in (3, 4):
      prompt, canvas = tokens[s:s + 1, :b * B], canvas_in[s:s + 1, b * B:(b + 1) * B]
      logits = run(params, prompt, canvas)
      if conditioned[s]:
        logits = run(params, prompt, canvas, logits)
      blocks.append(_token_nll(logits, tokens[s:s + 1, b * B:(b + 1) * B]).mean())
    decoder.append(np.mean(blocks))
  ar = _token_nll(ar_logits(params, cfg, tokens[:, :20])[:, :19], tokens[:, 1:20])
  want = np.mean(decoder) + 0.7 * ar.mean()
  _, metrics = jax.jit(lambda p, b: loss_fn(p, b, key, cfg))(params, batch)
  np.testing.assert_allclose(float(metrics["token_loss"]), want, rtol=2e-6)


def test_corruption_replaces_only_supervised_canvas_tokens_with_uniform_ones():
  cfg = replace(_cfg(p=0.0), objective=dict(eps_min=1.0, eps_max=1.0),
                model=dict(vocab_size=4096))  # t = 1: every supervised canvas token is drawn
  tokens, seg, protected = _sft_batch()
  batch = make_batch(cfg, tokens, seg, protected)
  _, (inputs, _), scored, weight = diffusiongemma.corrupt(jax.random.key(0), batch, cfg)
  inputs, labels = np.asarray(inputs), np.asarray(batch.labels)
  drawn = np.asarray(batch.maskable)
  assert drawn.sum() == 4 * (L - 12 - 5)
  np.testing.assert_array_equal(inputs[~drawn], np.asarray(batch.tokens)[~drawn])
  new = inputs[drawn]
  assert (new != np.asarray(batch.tokens)[drawn]).mean() > 0.99  # 1 - 1/4096 expected
  assert new.max() >= 250 and abs(new.mean() / 4095 - 0.5) < 0.1  # the whole vocabulary
  np.testing.assert_array_equal(np.asarray(scored), labels >= 0)
  noisy = np.asarray(batch.stream) == NOISY
  # The decoder's weights sum to 1 (a mean of means), the encoder's to its weight.
  np.testing.assert_allclose(np.asarray(weight)[noisy & (labels >= 0)].sum(), 1.0, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weight)[~noisy & (labels >= 0)].sum(), 0.7, rtol=1e-6)


@functools.cache
def _one_device():
  return test_gemma4.loss_and_grads(_cfg(), None, _sft_batch())


STRATEGIES = [
    *[(s, dict(seq=8)) for s in ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp",
                                  "csbp_allgather", "csbp_ring")],
    ("csbp_ring", dict(data=2, fsdp=2, seq=2, expert_axes="data,fsdp",
                       moe_dispatch="all_gather")),
]


@pytest.mark.parametrize(
    "strategy, parallel", STRATEGIES,
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_every_strategy_equals_one_device(strategy, parallel):
  """Self-conditioning on every sequence (both passes run), router losses on; the composed
  mesh also splits the experts and shards the weights (ZeRO-3)."""
  cfg = _cfg(strategy, **parallel)
  test_strategies.assert_close(*test_gemma4.loss_and_grads(cfg, make_mesh(cfg), _sft_batch()),
                               *_one_device())


def test_self_conditioning_needs_the_module():
  with pytest.raises(ConfigError, match=r"self_condition_p=0.5 needs the self-conditioning"):
    replace(_cfg(), model=dict(self_conditioning=False), objective=dict(self_condition_p=0.5))
  assert not replace(_cfg(p=0.0), model=dict(self_conditioning=False)).model.self_conditioning
