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


def test_packed_documents_are_refused(gdn_model):
  cfg = gdn_model[0]
  tokens = np.ones((1, L), np.int32)
  make_batch(cfg, tokens, segment_ids=np.array([[1] * (L - 2) + [0, 0]]))  # padding at the end
  with pytest.raises(ConfigError, match="one recurrence per sequence"):
    make_batch(cfg, tokens, segment_ids=np.array([[1] * (L // 2) + [2] * (L // 2)]))


def test_sampling_a_gdn_model_is_refused(gdn_model):
  from bdlm_jax.sample import sample
  cfg, params, _ = gdn_model
  with pytest.raises(ConfigError, match="does not run Gated DeltaNet"):
    sample(params, cfg, np.array([1, 2, 3]), jax.random.PRNGKey(0), max_new_tokens=4)
