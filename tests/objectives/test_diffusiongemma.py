"""The diffusiongemma objective as the seed's native SFT trains it (docs/diffusiongemma.md):
its loss *and gradients* equal an independent canvas-by-canvas reference built on
`canvas_logits` (which equals transformers' DiffusionGemma) on packed rows; corruption
touches only supervised canvas tokens, with uniform tokens, at times antithetic over the
response blocks; routers are frozen; an accumulated step equals the one big batch; every
strategy gives the one-device loss and gradients, self-conditioning and router losses on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import (ConfigError, ar_logits, canvas_logits, init_params, loss_fn, make_batch,
                      make_mesh)
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import NOISY
from bdlm_jax.models.transformer import Transformer
from bdlm_jax.objectives import diffusiongemma
from bdlm_jax.params import split_frozen
from bdlm_jax.spec import resolve
from bdlm_jax.train import _accumulated_grads, init_state, make_train_step
from tests.models import test_gemma4
from tests.parallel import test_strategies

L, B = 64, 4  # 16 canvases over 8 ranks
# Gemma 4's layers (tests/models/test_gemma4.py), one local and one global, self-conditioning
MODEL = dict(test_gemma4.GEMMA4, n_layers=2, last_layer_global=False, self_conditioning=True)
# (conversation starts, prompt lengths) per sequence; each conversation runs to the next
# start, the last to the padding. Sequence 0 starts its second conversation inside block 7,
# whose first half ends the first one, and its third conversation's prompt ends inside a block.
CONVERSATIONS = [((0, 30, 46), (10, 8, 3)), ((0,), (45,)), ((0, 20), (4, 6)), ((0, 8), (2, 2))]
PAD = 5  # the last PAD positions of every sequence


def _cfg(strategy="none", p=0.5, **parallel):
  return replace(test_strategies._cfg(strategy, B), model=MODEL, data=dict(seq_len=L),
                 objective=dict(name=diffusiongemma.NAME, self_condition_p=p,
                                encoder_loss_weight=0.7, loss_weight="unit"),
                 parallel=parallel)


def _packed_batch():
  """(tokens, segments, protected) [4, L] of `CONVERSATIONS`."""
  tokens = np.random.default_rng(11).integers(0, 250, (4, L))
  seg, protected = np.zeros((4, L), np.int32), np.zeros((4, L), bool)
  for s, (starts, prompts) in enumerate(CONVERSATIONS):
    for c, (start, end, prompt) in enumerate(zip(starts, (*starts[1:], L - PAD), prompts)):
      seg[s, start:end] = 7 + 3 * c  # any ids: the objective numbers them
      protected[s, start:start + prompt] = True
  return tokens, seg, protected


def _conversations(seg_row):
  """(start, end) of each conversation of a segment-id row."""
  bounds = np.flatnonzero(np.diff(seg_row, prepend=-1, append=-1))
  return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if seg_row[a] > 0]


def reference_loss(params, cfg, tokens, seg, protected, inputs, conditioned):
  """The seed's loss, canvas by canvas: a canvas (one conversation's part of a block) is
  scored from `canvas_logits` after its conversation's clean tokens before the block, with
  the self-conditioning logits of a first pass as a constant where its conversation draws
  them; CE averaged in the canvas, over the conversation's canvases, over conversations;
  plus encoder_loss_weight x the mean next-token CE of `ar_logits` over every conversation's
  pairs outside the last block. `inputs`, `conditioned`: the noisy positions' tokens and
  draws [S, L]."""
  run = jax.jit(lambda p, prompt, canvas, *sc: canvas_logits(p, cfg, prompt, canvas, *sc))
  decoder, pairs = [], []
  for s in range(tokens.shape[0]):
    for start, end in _conversations(seg[s]):
      canvases = []
      for b in range(start // B, -(-end // B)):
        lo, hi = max(b * B, start), min((b + 1) * B, end)
        scored = ~protected[s, lo:hi]
        if not scored.any():
          continue
        prompt, canvas = tokens[s:s + 1, start:lo], inputs[s:s + 1, lo:hi]
        logits = run(params, prompt, canvas)
        if conditioned[s, lo]:
          logits = run(params, prompt, canvas, jax.lax.stop_gradient(logits))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[0]), tokens[s, lo:hi, None], -1)
        canvases.append(jnp.sum(nll[scored, 0]) / scored.sum())
      decoder.append(jnp.mean(jnp.stack(canvases)))
      n = min(end, L - B) - start - (end <= L - B)  # pairs (p, p + 1) with p < L - B
      if n > 0:
        padded = np.pad(tokens[s, start:end], (0, -(end - start) % B))[None]
        logp = jax.nn.log_softmax(ar_logits(params, cfg, padded)[0, :n])
        pairs.append(-jnp.take_along_axis(logp, tokens[s, start + 1:start + n + 1, None], -1))
  encoder = jnp.mean(jnp.concatenate(pairs))
  return jnp.mean(jnp.stack(decoder)) + cfg.objective.encoder_loss_weight * encoder


def _draws(cfg, batch, key):
  """The noisy positions' input tokens and self-conditioning draws [S, L] (strategy none:
  noisy row p is position p)."""
  _, (inputs, conditioned), _, _ = diffusiongemma.corrupt(key, batch, cfg)
  return np.asarray(inputs)[:, :L], np.asarray(conditioned)[:, :L]


@pytest.mark.slow
def test_loss_equals_a_canvas_by_canvas_reference_on_packed_rows():
  """On one device, packed rows (a conversation starting inside a block, a prompt ending
  inside one), some conversations self-conditioned and some not."""
  cfg = _cfg(p=0.5)
  tokens, seg, protected = _packed_batch()
  batch = make_batch(cfg, tokens, seg, protected)
  params = test_gemma4.drawn_params(cfg, None)
  key = jax.random.key(3)
  inputs, conditioned = _draws(cfg, batch, key)
  firsts = [bool(conditioned[s, a]) for s in range(4) for a, _ in _conversations(seg[s])]
  assert any(firsts) and not all(firsts)
  assert len({bool(conditioned[0, a]) for a, _ in _conversations(seg[0])}) == 2  # in one row
  want = reference_loss(params, cfg, tokens, seg, protected, inputs, conditioned)
  _, metrics = jax.jit(lambda p, b: loss_fn(p, b, key, cfg))(params, batch)
  np.testing.assert_allclose(float(metrics["token_loss"]), float(want), rtol=2e-6)


@pytest.mark.slow
def test_gradients_equal_the_reference_s_with_constant_self_conditioning_logits():
  """One row of two conversations, the second starting inside a block, the first
  self-conditioned: every trained parameter's gradient equals the reference's, whose
  self-conditioning logits are constants (no gradient through the first pass, the tied
  embedding and head included); the frozen routers get none."""
  cfg = replace(_cfg(p=0.5), model=dict(moe_aux_weight=0.0),  # the CE alone
                train=dict(batch_size=1))
  tokens, seg, protected = (x[:1] for x in _packed_batch())
  seg[0, :22], seg[0, 22:34], seg[0, 34:] = 1, 2, 0
  protected[0, :18], protected[0, 22:27] = True, True
  batch = make_batch(cfg, tokens, seg, protected)
  params = test_gemma4.drawn_params(cfg, None)
  key = next(k for k in map(jax.random.key, range(50))
             if (lambda c: c[0, 0] and not c[0, 22])(_draws(cfg, batch, k)[1]))
  inputs, conditioned = _draws(cfg, batch, key)
  want, want_grads = jax.value_and_grad(
      lambda p: reference_loss(p, cfg, tokens, seg, protected, inputs, conditioned))(params)
  (loss, _), grads = jax.jit(jax.value_and_grad(
      lambda p: loss_fn(p, batch, key, cfg), has_aux=True))(params)
  grads, frozen = split_frozen(cfg, grads)
  want_grads, want_frozen = split_frozen(cfg, want_grads)
  assert not any(np.asarray(g).any() for g in jax.tree.leaves(frozen))
  assert all(np.asarray(g).any() for g in jax.tree.leaves(want_frozen))  # routers do matter
  test_strategies.assert_close(float(loss), _without_scalars(grads), float(want),
                               _without_scalars(want_grads))


def test_corruption_replaces_only_supervised_canvas_tokens_with_uniform_ones():
  cfg = replace(_cfg(p=0.0), objective=dict(eps_min=1.0, eps_max=1.0),
                model=dict(vocab_size=4096))  # t = 1: every supervised canvas token is drawn
  tokens, seg, protected = _packed_batch()
  batch = make_batch(cfg, tokens, seg, protected)
  _, (inputs, _), scored, weight = diffusiongemma.corrupt(jax.random.key(0), batch, cfg)
  inputs, labels = np.asarray(inputs), np.asarray(batch.labels)
  drawn = np.asarray(batch.maskable)
  assert drawn.sum() == ((seg > 0) & ~protected).sum()
  np.testing.assert_array_equal(inputs[~drawn], np.asarray(batch.tokens)[~drawn])
  new = inputs[drawn]
  assert (new != np.asarray(batch.tokens)[drawn]).mean() > 0.99  # 1 - 1/4096 expected
  assert new.max() >= 250 and abs(new.mean() / 4095 - 0.5) < 0.1  # the whole vocabulary
  noisy = np.asarray(batch.stream) == NOISY
  # 8 conversations, each weighing 1/8 in all, its canvases alike, tokens alike in one
  w = np.asarray(weight)[noisy & (labels >= 0)]
  np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)
  # sequence 1: one conversation, a prompt of 45: canvases 11 (3 tokens), 12, 13 (4 each), 14 (3)
  w1 = np.asarray(weight)[1, :L]
  np.testing.assert_allclose(w1[45:48], 1 / (8 * 4 * 3), rtol=1e-6)
  np.testing.assert_allclose(w1[48:56], 1 / (8 * 4 * 4), rtol=1e-6)
  np.testing.assert_allclose(w1[56:59], 1 / (8 * 4 * 3), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weight)[~noisy & (labels >= 0)].sum(), 0.7, rtol=1e-6)


def test_times_are_antithetic_over_response_blocks_only():
  """The seed draws t over the batch's response blocks: n of them get (u + i/n) mod 1 in
  (sequence, block) order; a block holding only prompt or padding takes no share."""
  cfg = _cfg()
  tokens, seg, protected = _packed_batch()
  batch = make_batch(cfg, tokens, seg, protected)
  t, _ = diffusiongemma.response_noise(jax.random.key(4), batch, cfg)
  response = np.zeros((4, L // B), bool)
  for s, p in zip(*np.nonzero((seg > 0) & ~protected)):
    response[s, p // B] = True
  t = (np.asarray(t)[response] - 1e-3) / (1 - 1e-3)
  n = response.sum()
  assert n < response.size
  np.testing.assert_allclose(np.sort((t - t[0]) % 1.0), np.arange(n) / n, atol=1e-5)


def test_a_conversation_drawn_unconditioned_gets_a_zero_soft_embedding(monkeypatch):
  """One small layer, one device, one row of two conversations drawn apart: the second pass
  conditions the first conversation's canvas rows on a soft embedding and gives the second's
  zeros, as the first pass gives every row (the fast tier's check of what the slow
  canvas-by-canvas references cover)."""
  cfg = replace(test_strategies._cfg("none", B), model=dict(n_layers=1, self_conditioning=True),
                data=dict(seq_len=L), train=dict(batch_size=1),
                objective=dict(name=diffusiongemma.NAME, self_condition_p=0.5,
                               loss_weight="unit"))
  tokens, seg, protected = (x[:1] for x in _packed_batch())
  seg[0, :22], seg[0, 22:] = 1, 2
  batch = make_batch(cfg, tokens, seg, protected)
  key = jax.random.key(1)  # draws the first conversation conditioned, not the second
  conditioned = _draws(cfg, batch, key)[1][0]
  np.testing.assert_array_equal(conditioned, np.arange(L) < 22)  # one draw a conversation
  softs = []
  condition = Transformer.self_condition
  def recorded(model, x_BRD, soft_BRD):
    jax.debug.callback(lambda soft: softs.append(np.asarray(soft)), soft_BRD)
    return condition(model, x_BRD, soft_BRD)
  monkeypatch.setattr(Transformer, "self_condition", recorded)
  jax.jit(lambda p, b: loss_fn(p, b, key, cfg))(init_params(cfg, jax.random.key(0)), batch)
  first, second = softs
  assert not first.any()
  assert second[0, :22].any(axis=-1).all() and not second[0, 22:].any()


@pytest.mark.slow
def test_accumulated_step_equals_the_one_big_batch():
  """grad_accum=2 against one batch of the same 4 sequences: the weights divide by the
  whole step's conversations and pairs, so the micro-batches add up exactly (corruption
  made deterministic: t ~ 0, every conversation self-conditioned)."""
  cfg = replace(_cfg(p=1.0), objective=dict(eps_min=1e-9, eps_max=1e-9),
                model=dict(moe_aux_weight=0.0), train=dict(batch_size=4))
  batch = make_batch(cfg, *_packed_batch())
  params = test_gemma4.drawn_params(cfg, None)

  def grads(accum):
    c = replace(cfg, train=dict(grad_accum=accum))
    trained, frozen = split_frozen(c, params)
    spec = resolve(c, make_mesh(c))
    return jax.jit(lambda p, b: _accumulated_grads(spec, p, frozen, b,
                                                   jax.random.key(0)))(trained, batch)

  (g1, m1), (g2, m2) = grads(1), grads(2)
  np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
  test_strategies.assert_close(float(m2["loss"]), _without_scalars(g2), float(m1["loss"]),
                               _without_scalars(g1))


def _without_scalars(grads):
  """The gradients but the layer scalars' (a fixed buffer: none in any)."""
  grads = jax.tree.map(np.asarray, grads)
  for stack in ("layers", "global_layers"):
    assert not grads[stack].pop("layer_scalar").any()
  return grads


@pytest.mark.slow
def test_routers_are_frozen_with_no_optimizer_state_on_a_composed_mesh():
  """One train step on data x fsdp x seq (ZeRO-3, csbp_ring, experts split): every router
  weight unchanged and absent from the optimiser state, every other weight moved;
  train.freeze="" trains them."""
  cfg = replace(_cfg("csbp_ring", data=2, fsdp=2, seq=2, expert_axes="data,fsdp",
                     moe_dispatch="all_gather"), train=dict(batch_size=4, warmup_steps=0))
  mesh = make_mesh(cfg)
  state = init_state(cfg, jax.random.key(0), mesh, test_gemma4.drawn_params(cfg, mesh))
  routers = split_frozen(cfg, state.params)[1]
  assert {"kernel", "router_scale", "expert_scale"} <= {
      str(getattr(p[-1], "key", "")) for p, _ in jax.tree_util.tree_leaves_with_path(routers)}
  opt_leaves = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_leaves_with_path(state.opt_state)}
  assert not any("router" in k or "expert_scale" in k for k in opt_leaves)
  new, metrics = make_train_step(cfg, mesh)(state, make_batch(cfg, *_packed_batch()),
                                            jax.random.key(1))
  assert not metrics["skipped"]
  old_params = jax.tree.map(np.asarray, test_gemma4.drawn_params(cfg, mesh))
  moved, kept = split_frozen(cfg, jax.tree.map(lambda a, b: bool((np.asarray(a) != b).any()),
                                               new.params, old_params))
  assert not any(jax.tree.leaves(kept))
  assert sum(jax.tree.leaves(moved)) >= len(jax.tree.leaves(moved)) - 2  # layer scalars stay
  assert split_frozen(replace(cfg, train=dict(freeze="")), state.params)[1] == {}


@functools.cache
def _one_device():
  return test_gemma4.loss_and_grads(_cfg(), None, _packed_batch())


STRATEGIES = [
    *[(s, dict(seq=8)) for s in ("cp_allgather", "cp_ring", "cp_ring_balanced", "bp",
                                  "csbp_allgather", "csbp_ring")],
    ("csbp_ring", dict(data=2, fsdp=2, seq=2, expert_axes="data,fsdp",
                       moe_dispatch="all_gather")),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, parallel", STRATEGIES,
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_every_strategy_equals_one_device(strategy, parallel):
  """Packed rows, self-conditioning drawn per conversation (both passes run), router losses
  on, routers frozen; the composed mesh also splits the experts and shards the weights."""
  cfg = _cfg(strategy, **parallel)
  test_strategies.assert_close(*test_gemma4.loss_and_grads(cfg, make_mesh(cfg), _packed_batch()),
                               *_one_device())


def test_config_rules():
  with pytest.raises(ConfigError, match=r"self_condition_p=0.5 needs the self-conditioning"):
    replace(_cfg(), model=dict(self_conditioning=False), objective=dict(self_condition_p=0.5))
  assert not replace(_cfg(p=0.0), model=dict(self_conditioning=False)).model.self_conditioning
  with pytest.raises(ConfigError, match=r"loss_weight='inv_t': diffusiongemma weighs every"):
    replace(_cfg(), objective=dict(loss_weight="inv_t"))
  tokens, seg, protected = _packed_batch()
  seg[0, -PAD - 2:-PAD] = seg[0, 0]  # the first conversation again, after the third
  with pytest.raises(ConfigError, match=r"each conversation's tokens contiguous"):
    make_batch(_cfg(), tokens, seg, protected)


def test_a_conversation_with_padding_between_its_turns_is_one_conversation():
  """data.supervise=assistant pads between turns (segment 0 inside a conversation): its
  turns stay one conversation (one weight, one self-conditioning draw), and only the
  responses are canvas labels."""
  # blocks: [pad prompt prompt prompt] [resp resp pad pad] [pad pad prompt prompt] [resp x4]
  seg = np.array([[0, 3, 3, 3, 3, 3, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 0, 0, 5, 5]])
  protected = np.array([[1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0]], bool)
  tokens = np.arange(1, seg.size + 1)[None]
  cfg = _cfg().objective  # block_size B
  rows = diffusiongemma.logical_rows(tokens, seg, protected, cfg)
  noisy_seg, noisy_labels = rows["seg"][0, :seg.size], rows["labels"][0, :seg.size]
  assert noisy_seg.tolist() == (np.where(seg[0] == 3, 1, 0) + np.where(seg[0] == 5, 2, 0)
                                ).tolist()
  assert np.flatnonzero(noisy_labels >= 0).tolist() == [4, 5, 12, 13, 14, 15, 19]
  with pytest.raises(ConfigError, match="returns to a segment id"):
    diffusiongemma.logical_rows(tokens, np.where(seg == 0, 5, seg), protected, cfg)
