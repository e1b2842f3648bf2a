"""Gated DeltaNet layers (models/gdn.py) under the BDLM stream: the clean stream is one
causal pass, a corrupted block starts from the clean state and conv rows before it, which is
the layer run on concat(clean[:bB], noisy block b) (the seed's reference); hybrids scan by
period with remat and row chunks; strategies and objectives that cannot run them refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.loss import ar_logits, canvas_logits, loss_fn
from bdlm_jax.params import init_params, merge
from bdlm_jax.spec import resolve

L, B = 8, 4  # two blocks: block 1 starts from the clean stream's state and conv rows
MODEL = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
             d_ff=32, layer_pattern="gdn", gdn_key_heads=1, gdn_value_heads=2, gdn_key_dim=4,
             gdn_value_dim=6, qk_norm=True, attention_gate=True, partial_rotary_factor=0.5)


def config(**model):
  return replace(Config(), model={**MODEL, **model}, data=dict(seq_len=L),
                 objective=dict(name="bd3lm", block_size=B, mask_token_id=31))


@pytest.fixture(scope="module")
def gdn_model():
  cfg = config()
  tokens = np.random.default_rng(0).integers(0, 30, (2, L))
  return cfg, init_params(cfg, jax.random.PRNGKey(0)), make_batch(cfg, tokens)


def stream_logits(cfg, params, batch, key):
  """(logits of every row of the training stream, its input tokens [noisy | clean])."""
  spec = resolve(cfg)
  model = merge(cfg, params)
  batch, inputs, _, _ = spec.objective.corrupt(key, batch, cfg)
  return model.logits(model(inputs, batch.pos, batch.meta, spec.attend["all"])), inputs


def concat_reference(cfg, params, inputs):
  """Block b's logits from a causal pass over concat(clean[:bB], noisy block b)."""
  noisy, clean = inputs[:, :L], inputs[:, L:]
  return jnp.concatenate([ar_logits(params, cfg, np.concatenate(
      [clean[:, :b * B], noisy[:, b * B:(b + 1) * B]], 1))[:, -B:] for b in range(L // B)], 1)


@pytest.mark.slow
def test_bd3lm_stream_equals_the_concat_reference_values_and_gradients(gdn_model):
  cfg, params, batch = gdn_model
  key = jax.random.PRNGKey(1)
  logits, inputs = jax.jit(lambda p: stream_logits(cfg, p, batch, key))(params)
  inputs = np.asarray(inputs)
  assert (inputs[:, :L] == 31).any() and (inputs[:, :L] != 31).any()  # partly masked blocks
  np.testing.assert_allclose(logits[:, :L], concat_reference(cfg, params, inputs), atol=1e-5)
  np.testing.assert_allclose(logits[:, L:], ar_logits(params, cfg, inputs[:, L:]), atol=1e-5)

  w = jax.random.normal(jax.random.PRNGKey(2), logits[:, :L].shape)
  grads = jax.jit(jax.grad(
      lambda p: jnp.sum(stream_logits(cfg, p, batch, key)[0][:, :L] * w)))(params)
  grads_ref = jax.jit(jax.grad(lambda p: jnp.sum(concat_reference(cfg, p, inputs) * w)))(params)
  assert_trees_close(grads, grads_ref)


def assert_trees_close(got, want, rel: float = 1e-4):
  """Every leaf within `rel` of its largest entry."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    err = float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-12))
    assert err < rel, f"{jax.tree_util.keystr(path)}: relative error {err}"


def test_canvas_logits_equal_the_concat_reference(gdn_model):
  cfg, params, _ = gdn_model
  rng = np.random.default_rng(1)
  prompt, canvas = rng.integers(0, 30, (2, 7)), rng.integers(0, 32, (2, 5))
  want = ar_logits(params, cfg, np.concatenate([prompt, canvas], 1))[:, -5:]
  np.testing.assert_allclose(canvas_logits(params, cfg, prompt, canvas), want, atol=1e-5)


@pytest.mark.slow
def test_hybrid_scans_by_period_with_remat_and_row_chunks_alike():
  """A GDN and a global layer per period over 3 layers (a period and a remainder): the loss
  and gradients with remat and row chunks equal those without."""
  tokens = np.random.default_rng(2).integers(0, 30, (2, L))
  plain = config(n_layers=3, layer_pattern="gdn,global")
  tuned = config(n_layers=3, layer_pattern="gdn,global", remat="full", row_chunks=2)
  params = init_params(plain, jax.random.PRNGKey(3))
  assert set(params) >= {"gdn_layers", "layers"}
  key = jax.random.PRNGKey(4)
  run = lambda cfg: jax.jit(jax.value_and_grad(
      lambda p: loss_fn(p, make_batch(cfg, tokens), key, cfg)[0]))(params)
  (loss, grads), (loss2, grads2) = run(plain), run(tuned)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  assert_trees_close(grads2, grads)


def test_an_objective_that_cannot_train_gdn_layers_refuses():
  with pytest.raises(ConfigError, match="cannot train Gated DeltaNet"):
    replace(config(), objective=dict(name="diffusiongemma", block_size=B, loss_weight="unit",
                                     self_condition_p=0.0))


def documents(seg_SL):
  """[(row, first, end)] of each document (segment id > 0, a run of one id) in packed rows."""
  out = []
  for r, row in enumerate(np.asarray(seg_SL)):
    cuts = [0, *np.flatnonzero(row[1:] != row[:-1]) + 1, len(row)]
    out += [(r, a, e) for a, e in zip(cuts, cuts[1:]) if row[a] > 0]
  return out


def one_document_a_row(cfg, params, pieces):
  """ar_logits of each token list in `pieces` as a row of its own (one batch, padded at the
  end: causal, so the padding changes nothing before it)."""
  n = max(map(len, pieces))
  tokens = np.zeros((len(pieces), n), np.int64)
  seg = np.zeros_like(tokens)
  for i, p in enumerate(pieces):
    tokens[i, :len(p)], seg[i, :len(p)] = p, 1
  logits = np.asarray(ar_logits(params, cfg, tokens, seg))
  return [logits[i, :len(p)] for i, p in enumerate(pieces)]


# Packed rows: documents that start mid-block (3, 7), at a block start (8, 4), one of one
# token, padding at the end.
PACKED_L = 12
PACKED_SEG = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0],
                       [1, 2, 2, 2, 4, 4, 4, 5, 5, 5, 5, 5]])


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["gdn", "global", "gdn,global"])
def test_ar_logits_of_packed_rows_equal_each_documents_own(pattern):
  cfg = config(layer_pattern=pattern)
  params = init_params(cfg, jax.random.PRNGKey(11))
  tokens = np.random.default_rng(12).integers(0, 30, (2, PACKED_L))
  got = np.asarray(ar_logits(params, cfg, tokens, PACKED_SEG))
  docs = documents(PACKED_SEG)
  want = one_document_a_row(cfg, params, [tokens[r, a:e] for r, a, e in docs])
  for (r, a, e), ref in zip(docs, want):
    np.testing.assert_allclose(got[r, a:e], ref, atol=1e-5, rtol=1e-5)
  if pattern == "gdn":  # the old call: one document a row, all of it
    np.testing.assert_allclose(ar_logits(params, cfg, tokens), one_document_a_row(
        cfg, params, list(tokens)), atol=1e-5, rtol=1e-5)


def test_packed_bd3lm_stream_equals_each_documents_concat_reference():
  """Packed rows: a noisy row of block b in document d reads d's clean rows before bB (none
  if d starts in or at block b) and d's noisy rows of block b up to it: the layer run on
  concat(clean[max(start, ..)..bB), noisy[max(bB, start)..]) of d alone; clean rows are d's
  own causal stream."""
  cfg = replace(config(), data=dict(seq_len=PACKED_L))
  params = init_params(cfg, jax.random.PRNGKey(13))
  tokens = np.random.default_rng(14).integers(0, 30, (2, PACKED_L))
  batch = make_batch(cfg, tokens, PACKED_SEG)
  logits, inputs = jax.jit(lambda p: stream_logits(cfg, p, batch, jax.random.PRNGKey(15)))(
      params)
  logits, inputs = np.asarray(logits), np.asarray(inputs)
  noisy, clean = inputs[:, :PACKED_L], inputs[:, PACKED_L:]
  assert (noisy == 31).any() and (noisy != 31).any()  # partly masked blocks
  pieces, where = [], []  # (row, stream offset, first, end) each piece's logits go to
  for r, a, e in documents(PACKED_SEG):
    pieces.append(clean[r, a:e])
    where.append((r, PACKED_L, a, e))
    for b in range(a // B, -(-e // B)):
      lo, hi = max(a, b * B), min(e, (b + 1) * B)
      pieces.append(np.concatenate([clean[r, a:lo], noisy[r, lo:hi]]))
      where.append((r, 0, lo, hi))
  for (r, off, lo, hi), ref in zip(where, one_document_a_row(cfg, params, pieces)):
    np.testing.assert_allclose(logits[r, off + lo:off + hi], ref[-(hi - lo):], atol=1e-5,
                               rtol=1e-5)


def test_a_denoising_step_over_the_cached_state_and_conv_tail_is_the_concat_reference(
    gdn_model):
  """The sampler commits a 2-token prompt after two padding slots (its state restarts, its
  conv tail is zero before the prompt, which the block's conv reaches), then denoises a
  partly masked block from the cache: the logits of the layers run on concat(prompt, block),
  the padding tokens unseen."""
  from bdlm_jax.sample import _model_json, _steps, empty_cache
  cfg, params, _ = gdn_model
  clean = np.random.default_rng(5).integers(0, 30, (1, L))
  block = np.where([True, False, True, False], 31, clean[:, B:])
  fns, zero = _steps(_model_json(cfg)), np.zeros((1, 1), np.int32)
  cache, _ = fns.commit(params, empty_cache(cfg.model, 1, L), clean[:, :B],
                        np.asarray([[0, 0, 1, 1]], np.int32), 0, zero)
  sampled = fns.denoise(params, cache, block, B, zero)
  reference = ar_logits(params, cfg, np.concatenate([clean[:, 2:B], block], 1))[:, -B:]
  np.testing.assert_allclose(sampled, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_sampling_a_gdn_hybrid_from_its_cache_equals_recomputing_the_context(gdn_model):
  """Token for token, greedy and first-hitting at temperature 1, a hybrid (a GDN layer, then
  attention) with prompts of 1 and 5 tokens in one batch: the cache (K/V, GDN state and conv
  tail as of the last committed block) against use_cache=false."""
  from bdlm_jax.sample import sample_batch
  cfg = config(layer_pattern="gdn,global")
  params = init_params(cfg, jax.random.PRNGKey(0))
  prompts = [np.array([1, 2, 3, 4, 5]), np.array([7])]
  for options in (dict(temperature=0.0), dict(strategy="first_hitting", steps_per_block=2,
                                              temperature=1.0)):
    cached, full = (sample_batch(params, cfg, prompts, jax.random.PRNGKey(1), max_new_tokens=8,
                                 eos_id=-1, use_cache=use_cache, **options)
                    for use_cache in (True, False))
    for c, f in zip(cached, full):
      assert len(c) == 8
      np.testing.assert_array_equal(c, f)