"""DFlash2 (docs/dflash.md, "DFlash2"): D-PACE and LK losses, the candidate selector, the
block convolution, sliding-window drafts (causal own block), the verifier's output multiplier
and soft cap, and locality anchors drawn from the step's key, each against a hand computation
(the drafter's window and block mask against a mask written from the anchors, the proposals
against a lattice built by hand), and the whole loss and its gradients under the strategies."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bdlm_jax import (ConfigError, draft_proposals, init_params, loss_fn, make_batch,
                      make_mesh)
from bdlm_jax.configure import replace
from bdlm_jax.checkpoint.hf_names import model_config_from_hf
from bdlm_jax.kernels.mask import allowed
from bdlm_jax.models.drafter import GroupedConv, windowed_drafts
from bdlm_jax.models.selector import CandidateSelector
from bdlm_jax.models.transformer import head_logits
from bdlm_jax.objectives import dflash
from bdlm_jax.objectives.dflash import dpace_weights
from bdlm_jax.params import merge
from bdlm_jax.parallel import prune
from bdlm_jax.parallel.registry import plan_for
from bdlm_jax.spec import resolve
from tests.objectives.test_dflash import A, B, L, _cfg, _logical_batch
from tests.parallel.test_strategies import assert_close

# The verifier's output multiplier and soft cap (Muse: 0.19612, 20), and a causal own block on
# the sliding layers (the seed's default), so that every test below runs them.
MULTIPLIER, SOFTCAP = 0.6, 3.0
DFLASH2 = dict(objective=dict(dflash_loss="dpace", lk_loss="lambda", kl_decay=2.0,
                              selector_rank=4, selector_top_k=64, selector_loss_alpha=0.7),
               drafter=dict(conv_taps=2, conv_group_size=8, window=12, sliding_causal=True),
               model=dict(output_multiplier=MULTIPLIER, logit_softcap=SOFTCAP))


def _cfg2(strategy="none", **parallel):
  return replace(_cfg(strategy, **parallel), **DFLASH2)


def _dpace_by_hand(p, m, alpha, kind):
  w = np.zeros_like(p)
  for idx in np.ndindex(p.shape[:-1]):
    c, prefix = 1.0, []
    for j in range(p.shape[-1]):
      c *= (1 - alpha) * p[idx][j] + alpha if m[idx][j] else 1.0
      prefix.append(c)
    for j in range(p.shape[-1]):
      suffix = sum(prefix[k] * m[idx][k] for k in range(j, p.shape[-1]))
      w[idx][j] = {"dpace": suffix, "dpace-cumulative-confidence-only": prefix[j],
                   "dpace-continuation-value-only": suffix / prefix[j]}[kind]
  return w


def test_dpace_weights_match_the_check_value_and_a_hand_computation():
  w = dpace_weights(np.array([0.8, 0.6, 0.4]), np.ones(3), 0.0)
  np.testing.assert_allclose(w, [1.472, 0.672, 0.192], rtol=1e-6)
  rng = np.random.default_rng(0)
  p, m = rng.random((3, 5, 6)), rng.random((3, 5, 6)) < 0.7
  for kind in dflash.dflash2.DPACE:
    np.testing.assert_allclose(dpace_weights(p, m, 0.3, kind), _dpace_by_hand(p, m, 0.3, kind),
                               rtol=1e-5)


def _one_device(params, cfg, batch, spec=None):
  """(the drafter's hidden states [S, A*B, D], their head logits [S, A, B, V]) on one
  device, in logical order (`spec`: resolve(cfg) unless given)."""
  spec = resolve(cfg) if spec is None else spec
  model = merge(cfg, params)
  batch, inputs, _, _ = spec.objective.corrupt(None, batch, cfg)
  hidden = spec.objective.hidden(spec, model, batch, inputs, None)[0]
  raw = head_logits(model.head, hidden, 0.0)  # the plain head; then by hand: m x, soft cap
  m, cap = cfg.model.output_multiplier, cfg.model.logit_softcap
  logits = cap * jnp.tanh(m * raw / cap) if cap else m * raw
  return hidden, logits.reshape(hidden.shape[0], A, B, -1)


def _reference_loss(params, cfg, batch, w, lam, ids):
  """DFlash2's loss written out on [S, A, B] (the seed's dflash2.py ~552-693), given its
  no-gradient parts: the D-PACE weights w, LK's lambda and the top-K candidate ids."""
  o = cfg.objective
  hidden, logits = _one_device(params, cfg, batch)
  labels = np.asarray(batch.labels[:, :A * B]).reshape(logits.shape[:3])
  m = labels >= 0
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), np.maximum(labels, 0)[..., None],
                            -1)[..., 0]
  num = jnp.sum(w * (lam * ce + (1 - lam) * (1 - jnp.exp(-ce))) * m)
  sel = params["drafter"]["selector"]
  tokens = np.asarray(batch.tokens[:, :A * B]).reshape(labels.shape)
  prev = np.concatenate([tokens[..., :1], tokens[..., :-1]], -1)
  unary = jnp.take_along_axis(logits, ids, -1)
  proj = hidden.reshape(*labels.shape, -1) @ sel["hidden_projection"]["kernel"]
  pred, succ = sel["predecessor_codebook"][prev], sel["successor_codebook"][ids]
  scores = unary + jnp.einsum("sabr,sabkr->sabk", pred * proj, succ)
  match = ids == labels[..., None]
  covered = m & match.any(-1)
  sel_ce = -jnp.take_along_axis(jax.nn.log_softmax(scores, -1), np.argmax(match, -1)[..., None],
                                -1)[..., 0]
  num = num + o.selector_loss_alpha * jnp.sum(jnp.where(covered, w * sel_ce, 0.0))
  return num / w.sum()


def _params(cfg):
  """Init params with the selector's successor codebook and the convolutions' coefficient
  projections non-zero (both start at zero), and both sides of the convolutions' base kernels
  apart from the identity they start as, so the test sees what they do."""
  params = init_params(cfg, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(1), 8))
  d = params["drafter"]
  d["selector"]["successor_codebook"] = 0.3 * jax.random.normal(
      next(keys), d["selector"]["successor_codebook"].shape)
  for part in ("attn", "mlp"):
    k = d["convs"][part]["kernel_projection"]["kernel"]
    d["convs"][part]["kernel_projection"]["kernel"] = 0.05 * jax.random.normal(next(keys), k.shape)
    base = d["convs"][part]["base_kernel"]
    d["convs"][part]["base_kernel"] = base + 0.3 * jax.random.normal(next(keys), base.shape)
  return params


@functools.cache
def _logits():
  """float64 [S, A, B, V]: the head's logits at the draft rows of `_single_device`."""
  params, batch = _single_device()[:2]
  out = jax.jit(functools.partial(_one_device, cfg=_cfg2()))(params, batch=batch)[1]
  return np.asarray(out, np.float64)


@functools.cache
def _single_device():
  cfg = _cfg2()
  params = _params(cfg)
  batch = make_batch(cfg, *_logical_batch())
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg), has_aux=True))
  (loss, metrics), grads = step(params, batch)
  return params, batch, float(loss), metrics, jax.tree.map(np.asarray, grads)


@pytest.mark.slow
def test_the_dflash2_loss_and_gradients_equal_a_hand_computation():
  cfg, o = _cfg2(), _cfg2().objective
  params, batch, loss, metrics, grads = _single_device()
  logits = _logits()
  labels = np.asarray(batch.labels[:, :A * B]).reshape(logits.shape[:3])
  m = labels >= 0
  p = np.exp(np.take_along_axis(logits, np.maximum(labels, 0)[..., None], -1)[..., 0]
             - np.log(np.exp(logits).sum(-1)))
  w = _dpace_by_hand(np.where(m, p, 0), m, o.dpace_alpha, o.dflash_loss) * m
  lam = o.kl_scale * np.exp(-o.kl_decay * p[m].mean())
  ids = np.argsort(-logits, -1)[..., :o.selector_top_k]
  assert (m & (ids == labels[..., None]).any(-1)).sum() > 4  # the selector's CE counts
  assert float(metrics["selector_coverage"]) > 0
  ref = jax.jit(jax.value_and_grad(
      lambda p: _reference_loss(p, cfg, batch, w.astype(np.float32), lam, ids)))
  want, want_grads = ref(params)
  assert_close(loss, grads["drafter"], float(want), jax.tree.map(np.asarray,
                                                                 want_grads["drafter"]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,parallel", [
    ("csbp_ring", dict(seq=4, draft_transport="kv")), ("cp_ring", dict(seq=4)),
    ("bp", dict(seq=2, data=2)), ("csbp_allgather", dict(seq=2, fsdp=2)),
    ("cp_replicated_drafts", dict(seq=4)), ("csbp_ring", dict(seq=4, draft_transport="query"))])
def test_every_strategy_gives_the_single_device_dflash2_loss_and_gradients(strategy, parallel):
  cfg = _cfg2(strategy, **parallel)
  mesh = make_mesh(cfg)
  params, _, ref_loss, _, ref_grads = _single_device()
  batch = make_batch(cfg, *_logical_batch())
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg, mesh), has_aux=True))
  (loss, _), grads = step(params, batch)
  assert_close(float(loss), jax.tree.map(np.asarray, grads["drafter"]), ref_loss,
               ref_grads["drafter"])


def test_the_block_convolution_is_causal_inside_each_block_and_never_crosses_one():
  d, b, taps, group = 8, 4, 3, 2
  conv = GroupedConv(d, b, taps, group, jnp.float32, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  conv.base_kernel[...] = rng.normal(size=(2, taps, d))
  conv.kernel_projection.kernel[...] = rng.normal(size=(d, 2 * taps * d // group))
  x = rng.normal(size=(2, 3 * b, d)).astype(np.float32)
  y, coef = conv.prepare(jnp.asarray(x))
  dyn = x @ np.asarray(conv.kernel_projection.kernel[...])  # [S, N, 2 * taps * G]
  dyn = dyn.reshape(2, 3 * b, 2, taps, d // group)
  want = np.zeros_like(x)
  for s, t, ch in np.ndindex(want.shape):
    for k in range(min(taps, t % b + 1)):  # never before the block's first row
      want[s, t, ch] += (conv.base_kernel[...][0, k, ch] + dyn[s, t, 0, k, ch // group]) * x[
          s, t - k, ch]
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(coef, dyn[:, :, 1], rtol=1e-5, atol=1e-5)
  z = rng.normal(size=x.shape).astype(np.float32)  # `finish`: side 1 on another input
  out = conv.finish(jnp.asarray(z), coef)
  want = np.zeros_like(z)
  for s, t, ch in np.ndindex(want.shape):
    for k in range(min(taps, t % b + 1)):
      want[s, t, ch] += (conv.base_kernel[...][1, k, ch] + dyn[s, t, 1, k, ch // group]) * z[
          s, t - k, ch]
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_a_windowed_draft_slot_sees_its_window_of_context_and_its_whole_block():
  w = 6
  tokens, seg, prot = _logical_batch()
  cfg = _cfg()
  rows = dflash.logical_rows(tokens, seg, prot, cfg.objective)
  meta = jax.tree.map(lambda x: x[:1], make_batch(cfg, tokens, seg, prot).meta)
  mask = np.asarray(allowed(windowed_drafts(meta, w), meta))[0]
  q = np.flatnonzero(rows["seg"][0, :A * B] > 0)
  anchor, pos = rows["block"][0, q], rows["pos"][0, q]
  doc = seg[0][np.minimum(anchor, L - 1)]
  k = np.arange(L)
  want = ((k >= np.maximum(pos - w + 1, 0)[:, None]) & (k < anchor[:, None])
          & (seg[0][None] == doc[:, None]))
  assert (mask[q, A * B:] == want).all()
  assert (mask[q, :A * B] == (rows["block"][0, None, :A * B] == anchor[:, None])
          & (rows["seg"][0, None, :A * B] > 0)).all()


def test_the_drafter_applies_its_window():
  losses = {}
  for w in (0, 4):
    cfg = replace(_cfg(), drafter=dict(window=w))
    params = init_params(cfg, jax.random.key(0))
    loss = jax.jit(lambda p, b: loss_fn(p, b, None, cfg)[0])
    losses[w] = float(loss(params, make_batch(cfg, *_logical_batch())))
  assert abs(losses[4] - losses[0]) > 1e-4


def test_locality_anchors_are_a_wrapped_coprime_stride_from_a_uniform_start():
  ok = np.zeros((1, 100), bool)
  ok[0, 10:90] = True  # 80 candidates: stride 4 -> 5 -> 7 (coprime with 80)
  draws = [dflash.pick_anchors(ok, 6, "locality", seed, block_size=4)[0] for seed in range(40)]
  for a in draws:
    i = a - 10
    assert len(set(i)) == 6 and (np.diff(a) > 0).all()
    start = [s for s in i if all(((s + 7 * j) % 80) in i for j in range(6))]
    assert start, i  # the set is {start + 7 j mod 80}
  assert len({tuple(a) for a in draws}) > 10  # the start is random


def test_the_selectors_greedy_path_follows_its_best_candidate_after_each_choice():
  sel = CandidateSelector(6, 20, 3, jnp.float32, nnx.Rngs(0))
  rng = np.random.default_rng(2)
  sel.successor_codebook[...] = rng.normal(size=(20, 3))
  h = rng.normal(size=(2, 5, 6)).astype(np.float32)
  ids = rng.integers(0, 20, (2, 5, 4))
  unary = rng.normal(size=(2, 5, 4)).astype(np.float32)
  anchor = np.array([3, 7])
  path = np.asarray(sel.greedy_path(h, anchor, ids, unary))
  pred, succ = np.asarray(sel.predecessor_codebook[...]), np.asarray(sel.successor_codebook[...])
  proj = np.asarray(sel.hidden_projection.kernel[...])
  for s in range(2):
    prev = anchor[s]
    for t in range(5):
      scores = unary[s, t] + succ[ids[s, t]] @ (pred[prev] * (h[s, t] @ proj))
      prev = ids[s, t][np.argmax(scores)]
      assert path[s, t] == prev


def test_draft_proposals_with_and_without_the_selector():
  cfg = _cfg2()
  params = _single_device()[0]
  tokens, seg, prot = _logical_batch()
  plain, rows = draft_proposals(params, cfg, tokens, seg, prot, selector=False)
  chosen, _ = draft_proposals(params, cfg, tokens, seg, prot)
  assert (np.asarray(rows.tokens) == np.asarray(_single_device()[1].tokens)).all()
  logits = _logits()
  assert plain.shape == (4, A, B - 1) and (np.asarray(plain) == logits[:, :, 1:].argmax(-1)).all()
  top = np.argsort(-logits[:, :, 1:], -1)[..., :cfg.objective.selector_top_k]
  assert (np.asarray(chosen)[..., None] == top).any(-1).all()  # always one of the top-K
  assert (np.asarray(chosen) != np.asarray(plain)).any()  # and the selector re-ranks them


@pytest.mark.parametrize("override,message", [
    (dict(objective=dict(lk_loss="tv")), "set objective.dflash_loss"),
    (dict(objective=dict(dflash_loss="dpace", draft_loss="kl")), "hard-label CE"),
    (dict(drafter=dict(window=2)), "must be >= objective.block_size"),
    (dict(drafter=dict(conv_taps=5)), "conv_taps=5 must be <="),
    (dict(objective=dict(dflash_loss="dpace", dpace_alpha=1.5)), "dpace_alpha must be in"),
    (dict(objective=dict(dflash_loss="dflash"), train=dict(grad_accum=2)), "grad_accum=1"),
])
def test_bad_dflash2_configs_fail_at_load(override, message):
  with pytest.raises(ConfigError, match=message):
    replace(_cfg(), **override)


def test_the_convolution_refuses_a_layout_that_splits_draft_blocks():
  cfg = replace(_cfg2("cp_ring", seq=4), objective=dict(max_anchors=12))
  with pytest.raises(ConfigError, match="whole draft blocks"):
    dflash._check_whole_blocks(plan_for(cfg))
  dflash._check_whole_blocks(plan_for(_cfg2("cp_ring", seq=4)))  # 8 blocks: 1 per chunk


PRUNED = dict(drafter=dict(window=4))  # windows of 4 over 64 positions: most rows unreached


@functools.cache
def _unpruned_single_device():
  cfg = replace(_cfg2(), **PRUNED)
  params = _params(cfg)
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg)[0]))
  loss, grads = step(params, make_batch(cfg, *_logical_batch()))
  return params, float(loss), jax.tree.map(np.asarray, grads["drafter"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,parallel", [
    ("csbp_ring", dict(seq=4, draft_transport="query")), ("bp", dict(seq=2, data=2))])
def test_context_pruning_keeps_the_loss_and_gradients_of_every_row(strategy, parallel):
  """12 context rows a rank (of 16, whose rows serve every rank's rotating queries; of 32
  under bp, which prunes to its own anchors) give the loss and gradients of one device that
  keeps all 64."""
  cfg = replace(_cfg2(strategy, **parallel), drafter=dict(window=4, kept_context_rows=12))
  mesh = make_mesh(cfg)
  params, ref_loss, ref_grads = _unpruned_single_device()
  prune = resolve(cfg, mesh).attend["draft"].prune
  assert prune is not None
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg, mesh)[0]))
  loss, grads = step(params, make_batch(cfg, *_logical_batch()))
  assert_close(float(loss), jax.tree.map(np.asarray, grads["drafter"]), ref_loss, ref_grads)


def test_pruning_keeps_only_rows_of_each_anchors_own_document():
  """W = 8, document 2 starting at 20, anchors 18 (document 1), 22 and 35: the kept rows are
  the union of [max(document start, a - W + 1), a), as the seed keeps them: 11-17, 20-21 and
  28-34, not 15-19 of document 1 for anchor 22."""
  pos = np.arange(40)
  anchors = prune.sorted_anchors(np.array([35, 22, 18, 22]), np.array([2, 2, 1, 2]))
  kept = pos[prune.reached(*anchors, pos, np.where(pos < 20, 1, 2), 8)]
  assert kept.tolist() == [*range(11, 18), 20, 21, *range(28, 35)]


def test_a_batch_whose_windows_reach_more_rows_than_are_kept_trains_in_a_wider_step():
  """kept_context_rows=8 where this batch's windows reach 9 of a rank's 16 context rows: the
  batch is not refused; its kept rows are padded to the first doubling that holds them (16),
  and that step, compiled for the wider batch, keeps one device's loss and gradients."""
  cfg = replace(_cfg2("csbp_ring", seq=4), drafter=dict(window=4, kept_context_rows=8))
  batch = make_batch(cfg, *_logical_batch())
  by_rank = batch.kept.reshape(batch.kept.shape[0], 4, -1)
  assert by_rank.shape[-1] == 16 and (by_rank >= 0).sum(-1).max() == 9
  mesh = make_mesh(cfg)
  params, ref_loss, ref_grads = _unpruned_single_device()
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None, cfg, mesh)[0]))
  loss, grads = step(params, batch)
  assert_close(float(loss), jax.tree.map(np.asarray, grads["drafter"]), ref_loss, ref_grads)


def test_capacity_doubles_the_configured_rows_up_to_the_whole_slot():
  cfg = replace(_cfg2("csbp_ring", seq=2), drafter=dict(window=4, kept_context_rows=5))
  plan = plan_for(cfg)
  whole = plan.rows_per_rank - plan.n_noisy
  assert [prune.capacity(cfg, plan, n) for n in (0, 5, 6, 11, whole)] == [5, 5, 10, 20, whole]
  kept = np.array([[0, 3, -1, 7, -1, -1]])
  assert prune.widen(kept, plan, 4).tolist() == [[0, 3, -1, -1, 7, -1, -1, -1]]


def _attend_by_hand(rows, window: int, causal: bool):
  """A drafter layer's `attend` on one device whose mask is written from the logical rows
  alone (anchors, slots, documents; never the row metadata it is handed): draft slot j of
  anchor a sees its block's slots (those <= j if `causal`) and the context positions c of
  a's document with max(a + j - W + 1, 0) <= c < a. GQA: query head h reads K/V head h // G."""
  n = A * B
  anchor, pos, doc = (rows[k][:, :n] for k in ("block", "pos", "seg"))
  valid, slot = doc > 0, np.arange(n) % B
  c = np.arange(L)
  ctx = (valid[..., None] & (rows["seg"][:, None, n:] == doc[..., None])
         & (c < anchor[..., None]) & (c >= pos[..., None] - window + 1))
  same = (np.arange(n)[:, None] // B == np.arange(n)[None] // B)
  if causal:
    same &= slot[None] <= slot[:, None]
  own = valid[..., None] & valid[:, None, :] & same
  mask = jnp.asarray(np.concatenate([own, ctx], -1))  # [S, A*B, A*B + L]

  def attend(q, k, v, q_meta, k_meta, k_ctx, v_ctx, ctx_meta):
    del q_meta, k_meta, ctx_meta
    g = q.shape[2] // k.shape[2]
    keys = jnp.repeat(jnp.concatenate([k, k_ctx], 1), g, axis=2)
    values = jnp.repeat(jnp.concatenate([v, v_ctx], 1), g, axis=2)
    s = jnp.einsum("sqhd,skhd->shqk", q, keys, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None], s * q.shape[-1] ** -0.5, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    p = jnp.where(mask[:, None], jnp.exp(s - lse[..., None]), 0.0)
    out = jnp.einsum("shqk,skhd->sqhd", p, values.astype(jnp.float32))
    return out.astype(q.dtype), jnp.moveaxis(lse, 1, 2)

  attend.prune = None
  return attend


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_the_drafters_window_and_block_mask_equal_a_mask_written_from_the_anchors(causal):
  """End to end: the drafter's hidden states under its own attention (metadata, windows,
  kernels) equal those under `_attend_by_hand`, both convolution sides and the multiplier on."""
  cfg = replace(_cfg2(), drafter=dict(sliding_causal=causal))
  params, (tokens, seg, prot) = _params(cfg), _logical_batch()
  batch = make_batch(cfg, tokens, seg, prot)
  rows = dflash.logical_rows(tokens, seg, prot, cfg.objective)
  spec = resolve(cfg)
  by_hand = dataclasses.replace(spec, attend=dict(
      spec.attend, draft=_attend_by_hand(rows, cfg.drafter.window, causal)))
  run = lambda s: jax.jit(lambda p: _one_device(p, cfg, batch, s)[0])(params)
  valid = rows["seg"][:, :A * B] > 0
  got, want = np.asarray(run(spec))[valid], np.asarray(run(by_hand))[valid]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  other = replace(cfg, drafter=dict(sliding_causal=not causal))  # and the flag matters
  assert np.abs(np.asarray(jax.jit(lambda p: _one_device(p, other, batch)[0])(params))[valid]
                - want).max() > 1e-3


def test_draft_proposals_follow_a_lattice_built_by_hand():
  """The selector's proposals: at each anchor's block, a lattice [B-1, K prev, K cur] of
  scores unary(c) + pred[prev] . (W h) . succ[c], the anchor's token (read from the data) the
  predecessor of slot 1, then the greedy path through it (the seed's `build_lattice` /
  `greedy_path`, dflash2.py ~430-470)."""
  cfg = _cfg2()
  params = _single_device()[0]
  params = jax.tree.map(lambda x: x, params)  # a copy: a stronger predecessor codebook
  sel = params["drafter"]["selector"]
  sel["predecessor_codebook"] = 50.0 * sel["predecessor_codebook"]
  tokens, seg, prot = _logical_batch()
  chosen = np.asarray(draft_proposals(params, cfg, tokens, seg, prot)[0])
  rows = dflash.logical_rows(tokens, seg, prot, cfg.objective)
  hidden, logits = (np.asarray(x, np.float64) for x in _one_device(params, cfg, make_batch(
      cfg, tokens, seg, prot)))
  k_top = cfg.objective.selector_top_k
  pred, succ, proj = (np.asarray(x, np.float64) for x in (
      sel["predecessor_codebook"], sel["successor_codebook"], sel["hidden_projection"]["kernel"]))
  firsts = 0
  for s, a in np.ndindex(4, A):
    if rows["seg"][s, a * B] == 0:
      continue
    h = hidden[s, a * B + 1:(a + 1) * B] @ proj  # [B-1, r]
    ids = np.argsort(-logits[s, a, 1:], -1, kind="stable")[:, :k_top]  # [B-1, K]
    unary = np.take_along_axis(logits[s, a, 1:], ids, -1)
    prev = np.concatenate([np.full((1, k_top), tokens[s, rows["block"][s, a * B]]), ids[:-1]])
    lattice = unary[:, None, :] + np.einsum("tpr,tr,tcr->tpc", pred[prev], h, succ[ids])
    at, path = 0, []
    for t in range(B - 1):
      at = int(np.argmax(lattice[t, at]))
      path.append(ids[t, at])
    assert (chosen[s, a] == path).all(), (s, a, chosen[s, a], path)
    firsts += path[0] != ids[0, 0]
  assert firsts > 0  # the anchor's token decides some first choices


def test_anchors_are_drawn_from_the_steps_key_the_same_under_every_layout():
  tokens, seg, prot = _logical_batch()
  cfg = _cfg2()
  anchors = lambda key, c=cfg: dflash.logical_rows(tokens, seg, prot, c.objective, key=key)[
      "block"][:, :A * B]
  k1, k2 = jax.random.key(1), jax.random.key(2)
  assert (anchors(k1) == anchors(k1)).all() and not (anchors(k1) == anchors(k2)).all()
  assert not (anchors(k1) == anchors(None)).all() and (anchors(None) == anchors(None)).all()
  for name in ("uniform", "locality"):  # both samplers read the key
    c = replace(cfg, objective=dict(anchors=name))
    assert not (anchors(k1, c) == anchors(k2, c)).all()
  batch = make_batch(cfg, tokens, seg, prot, key=k1)
  spread = make_batch(_cfg2("csbp_ring", seq=4), tokens, seg, prot, key=k1)
  for b in (batch, spread):  # the same anchors wherever the layout puts their blocks
    draft = (np.asarray(b.stream) == 0) & (np.asarray(b.seg) > 0)
    got = [sorted(set(np.asarray(b.block)[s][draft[s]])) for s in range(4)]
    want = [sorted(set(anchors(k1)[s][rows_seg > 0])) for s, rows_seg in enumerate(
        dflash.logical_rows(tokens, seg, prot, cfg.objective, key=k1)["seg"][:, :A * B])]
    assert got == want


def test_a_causal_block_needs_a_sliding_window():
  with pytest.raises(ConfigError, match="sliding_causal=true .* drafter.window > 0"):
    replace(_cfg(), drafter=dict(sliding_causal=True))
  with pytest.raises(ConfigError, match="output_multiplier"):
    replace(_cfg(), model=dict(output_multiplier=0.0))


def test_the_verifiers_output_multiplier_is_imported_from_its_config():
  hf = dict(model_type="llama", vocab_size=10, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=16)
  assert "output_multiplier" not in model_config_from_hf(hf, "x")  # 1: the default
  assert model_config_from_hf(dict(hf, output_multiplier=0.19612), "x")[
      "output_multiplier"] == 0.19612
  with pytest.raises(ConfigError, match="output_multiplier=0 must be > 0"):
    model_config_from_hf(dict(hf, output_multiplier=0), "x")
