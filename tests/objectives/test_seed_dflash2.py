"""Oracle tests: DFlash2 beside the seed's own code (Turbo-dLLM 0.1.6, package
`dllm_parallel`), on identical weights and inputs:
* the block convolution, `DFlashGroupedConv.prepare` / `finish` (both sides of a random base
  kernel, a random coefficient projection; core/models/backbones/dflash/dflash2.py ~257-328);
* the candidate selector, `CandidateSelector.score_candidates`, `build_lattice`, `greedy_path`
  (~389-470);
* D-PACE, `DFlash2Model._dpace_weight`, all three kinds;
* the losses, `DFlash2Model.distributed_dflash_loss` (~540-693) on our drafter's hidden states
  and our frozen head, {dflash, dpace} x {none, tv, lambda} with the selector, the verifier's
  output multiplier and soft cap: values, and the gradient to the hidden states;
* anchors: `_valid_anchor_mask`, the support of `_sample_locality_anchors`, and a new draw
  each batch (core/objectives/dflash.py ~116-117, ~368-510).

Not run here: the seed's attention (FlashAttention-4 CuTe kernels, CUDA only), so the draft
mask (window, causal own block) is checked against a mask written from the anchors instead
(tests/objectives/test_dflash2.py). Skipped where `dllm_parallel` or torch is not installed
(docs/tests.md)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("dllm_parallel.core.models.backbones.dflash.dflash2")

from dllm_parallel.core.models.backbones.dflash.dflash2 import (  # noqa: E402
    CandidateSelector as SeedSelector, DFlash2Model, DFlashGroupedConv)
from dllm_parallel.core.objectives.dflash import (  # noqa: E402
    _position_weights, _sample_anchors, _sample_locality_anchors, _valid_anchor_mask)

from bdlm_jax import make_batch  # noqa: E402
from bdlm_jax.configure import replace  # noqa: E402
from bdlm_jax.models.drafter import GroupedConv  # noqa: E402
from bdlm_jax.models.selector import CandidateSelector  # noqa: E402
from bdlm_jax.models.transformer import head_logits  # noqa: E402
from bdlm_jax.objectives import dflash, dflash2  # noqa: E402
from bdlm_jax.params import merge  # noqa: E402
from bdlm_jax.spec import resolve  # noqa: E402
from tests.objectives.test_dflash import A, B, _logical_batch  # noqa: E402
from tests.objectives.test_dflash2 import _cfg2, _one_device, _params  # noqa: E402

T = lambda x, dtype=torch.float32: torch.tensor(np.asarray(x), dtype=dtype)  # noqa: E731


def test_the_block_convolution_equals_the_seeds():
  d, b, taps, group = 16, 4, 3, 4
  seed = DFlashGroupedConv(d, b, taps, group)
  ours = GroupedConv(d, b, taps, group, jnp.float32, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  base = rng.normal(size=(2, taps, d)).astype(np.float32)  # both sides apart
  proj = rng.normal(size=(2 * taps * d // group, d)).astype(np.float32)  # torch: [out, in]
  with torch.no_grad():
    seed.base_kernel.copy_(T(base))
    seed.kernel_projection.weight.copy_(T(proj))
  ours.base_kernel[...] = base
  ours.kernel_projection.kernel[...] = proj.T
  x, z = (rng.normal(size=(2, 3 * b, d)).astype(np.float32) for _ in range(2))
  with torch.no_grad():
    want_y, want_coef = seed.prepare(T(x))
    want_out = seed.finish(T(z), want_coef)
  y, coef = ours.prepare(jnp.asarray(x))
  np.testing.assert_allclose(y, want_y.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(coef, want_coef.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours.finish(jnp.asarray(z), coef), want_out.numpy(), rtol=1e-5,
                             atol=1e-5)


def _selectors(h, v, r, k):
  seed = SeedSelector(hidden_size=h, vocab_size=v, state_rank=r, top_k=k, initializer_range=0.02)
  ours = CandidateSelector(h, v, r, jnp.float32, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  pred, succ = (rng.normal(size=(v, r)).astype(np.float32) for _ in range(2))
  proj = rng.normal(size=(r, h)).astype(np.float32)
  with torch.no_grad():
    seed.predecessor_codebook.copy_(T(pred))
    seed.successor_codebook.copy_(T(succ))
    seed.hidden_projection.weight.copy_(T(proj))
  ours.predecessor_codebook[...], ours.successor_codebook[...] = pred, succ
  ours.hidden_projection.kernel[...] = proj.T
  return seed, ours


def test_the_selectors_scores_lattice_and_greedy_path_equal_the_seeds():
  s, l, h, v, r, k = 3, 5, 6, 20, 3, 4
  seed, ours = _selectors(h, v, r, k)
  rng = np.random.default_rng(2)
  hid = rng.normal(size=(s, l, h)).astype(np.float32)
  ids = np.stack([[rng.permutation(v)[:k] for _ in range(l)] for _ in range(s)])
  unary = rng.normal(size=(s, l, k)).astype(np.float32)
  prev, anchor = rng.integers(0, v, (s, l)), rng.integers(0, v, s)
  kw = lambda: dict(candidate_ids=T(ids, torch.long), unary_logits=T(unary),
                    hidden_states=T(hid))
  with torch.no_grad():
    scores = seed.score_candidates(predecessor_ids=T(prev, torch.long), **kw())
    lattice = seed.build_lattice(anchor_token_ids=T(anchor, torch.long), **kw())
    path = seed.greedy_path(anchor_token_ids=T(anchor, torch.long), **kw())
  np.testing.assert_allclose(ours(hid, prev, ids, unary), scores.numpy(), rtol=1e-5, atol=1e-5)
  prev_lp = np.concatenate([np.broadcast_to(anchor[:, None, None], (s, 1, k)), ids[:, :-1]], 1)
  ours_lattice = np.stack([ours(hid, prev_lp[..., p], ids, unary) for p in range(k)], 2)
  np.testing.assert_allclose(ours_lattice, lattice.numpy(), rtol=1e-5, atol=1e-5)
  assert (np.asarray(ours.greedy_path(hid, anchor, ids, unary)) == path.numpy()).all()


def test_dpace_weights_equal_the_seeds():
  rng = np.random.default_rng(3)
  p, m = rng.random((3, 5, 6)), (rng.random((3, 5, 6)) < 0.7)
  for kind in dflash2.DPACE:
    for alpha in (0.0, 0.5):
      want = DFlash2Model._dpace_weight(T(p), T(m), alpha=alpha, loss_kind=kind)
      np.testing.assert_allclose(dflash2.dpace_weights(p, m, alpha, kind), want.numpy(),
                                 rtol=1e-5)


def _head_weight(model, d: int) -> np.ndarray:
  """[V, D]: the frozen head as a matrix, read through `head_logits` (tied or not)."""
  return np.asarray(head_logits(model.head, jnp.eye(d)[None], 0.0)[0]).T


def _seed_loss(cfg, params, batch, hidden, multiplier=None):
  """The seed's DFlash2 loss (and its gradient to the hidden states) on our drafter's hidden
  states [S, A*B, D], our frozen head and our selector's weights; `self` is a stand-in
  holding what `distributed_dflash_loss` reads (one rank: no all-reduce)."""
  o, m, n = cfg.objective, cfg.model, A * B
  model = merge(cfg, params)
  sel = params["drafter"]["selector"]
  seed_sel, _ = _selectors(m.d_model, m.vocab_size, o.selector_rank, o.selector_top_k)
  with torch.no_grad():
    seed_sel.predecessor_codebook.copy_(T(sel["predecessor_codebook"]))
    seed_sel.successor_codebook.copy_(T(sel["successor_codebook"]))
    seed_sel.hidden_projection.weight.copy_(T(np.asarray(sel["hidden_projection"]["kernel"]).T))
  fake = types.SimpleNamespace(
      lm_head=types.SimpleNamespace(weight=T(_head_weight(model, m.d_model))),
      candidate_selector=seed_sel, block_size=B, runtime=None,
      config=types.SimpleNamespace(
          output_multiplier=m.output_multiplier if multiplier is None else multiplier,
          final_logit_softcapping=m.logit_softcap or None),
      _dpace_weight=DFlash2Model._dpace_weight)
  fake._global_detached_sum = lambda v: DFlash2Model._global_detached_sum(fake, v)
  s = batch.tokens.shape[0]
  h = T(hidden).requires_grad_(True)
  labels = np.asarray(batch.labels[:, :n])
  weights = _position_weights(block_size=B, gamma=o.gamma, sample_from_anchor=False,
                              device=torch.device("cpu"))
  output = types.SimpleNamespace(
      hidden_states=h, supervised_mask=T(labels >= 0, torch.bool),
      target_token_ids=T(batch.tokens[:, :n], torch.long),  # the anchor's token at slot 0
      position_weights=weights.expand(s, A, B).reshape(s, n))
  loss = DFlash2Model.distributed_dflash_loss(
      fake, output, loss_kind=o.dflash_loss, normalization_count=torch.tensor(1.0),
      bp_loss_scale=1.0, dpace_alpha=o.dpace_alpha, lk_loss_type=o.lk_loss or None,
      kl_scale=o.kl_scale, kl_decay=o.kl_decay, selector_loss_alpha=o.selector_loss_alpha)
  loss.backward()
  return float(loss.detach()), h.grad.numpy()


def _our_loss(cfg, params, batch, hidden):
  """Our DFlash2 loss (`dflash2.rows_loss`) of the same hidden states, and its gradient."""
  spec, model = resolve(cfg), merge(cfg, params)
  batch, _, scored, weight = spec.objective.corrupt(None, batch, cfg)
  loss = lambda h: dflash2.rows_loss(spec, model, batch, h, scored, weight)[0]
  value, grad = jax.value_and_grad(loss)(jnp.asarray(hidden))
  return float(value), np.asarray(grad)


@pytest.mark.slow
def test_the_dflash2_losses_with_multiplier_and_soft_cap_equal_the_seeds():
  base = _cfg2()
  assert base.model.output_multiplier != 1 and base.model.logit_softcap
  params, batch = _params(base), make_batch(base, *_logical_batch())
  # Our drafter's hidden states, scaled so that the head's logits spread (at init they are
  # near zero, where the multiplier hardly shows).
  hidden = 10 * np.asarray(jax.jit(lambda p: _one_device(p, base, batch)[0])(params))
  for loss in ("dflash", "dpace"):
    for lk in ("", "tv", "lambda"):
      cfg = replace(base, objective=dict(dflash_loss=loss, lk_loss=lk))
      ours, our_grad = _our_loss(cfg, params, batch, hidden)
      want, want_grad = _seed_loss(cfg, params, batch, hidden)
      assert abs(ours - want) <= 2e-5 * abs(want), (loss, lk, ours, want)
      if (loss, lk) == ("dpace", "lambda"):
        rel = np.linalg.norm(our_grad - want_grad) / np.linalg.norm(want_grad)
        assert rel < 1e-4, rel
        unscaled, _ = _seed_loss(cfg, params, batch, hidden, multiplier=1.0)
        assert abs(unscaled - want) > 1e-2  # the multiplier is what made them agree


def test_valid_anchors_equal_the_seeds():
  tokens, seg, prot = _logical_batch()
  want = _valid_anchor_mask(loss_mask=T((seg > 0) & ~prot, torch.bool),
                            document_ids=T(np.where(seg > 0, seg, -1), torch.long))
  assert (dflash.anchor_candidates(seg, prot) == want.numpy()).all()


def test_locality_anchors_have_the_seeds_support_and_both_redraw_each_batch():
  ok = np.zeros((1, 30), bool)
  ok[0, [1, 2, 4, 7, 8, 11, 15, 20, 21, 26]] = True  # 10 candidates: stride 4 -> 7
  gen = torch.Generator().manual_seed(0)
  seed = {tuple(_sample_locality_anchors(T(ok, torch.bool), max_anchors=3, group_size=0,
                                         group_stride=4, generator=gen)[0][0].tolist())
          for _ in range(200)}
  ours = {tuple(dflash.pick_anchors(ok, 3, "locality", i, block_size=4)[0]) for i in range(200)}
  assert ours == seed and len(seed) == 10
  # A new draw each batch: the seed's generator advances; ours reads each step's key.
  gen = torch.Generator().manual_seed(0)
  draws = [_sample_anchors(T(ok, torch.bool), max_anchors=3, generator=gen)[0] for _ in range(2)]
  assert not torch.equal(*draws)
  tokens, seg, prot = _logical_batch()
  cfg = _cfg2()
  step_key = jax.random.key(0)
  ours = [dflash.logical_rows(tokens, seg, prot, cfg.objective,
                              key=jax.random.fold_in(step_key, step))["block"] for step in (0, 1)]
  assert not (ours[0] == ours[1]).all()
