"""Scaled RoPE as a model property: each layer kind's frequencies, bad scalings refused at
load, and every strategy applying it at each row's global position (transformers parity:
tests/checkpoint/test_hf_rope.py)."""

import json
import os

import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import ModelConfig
from bdlm_jax.configure import load_config
from bdlm_jax.errors import ConfigError
from bdlm_jax.models import rope
from bdlm_jax.models.pattern import layer_rope
from bdlm_jax.parallel.registry import get_strategy, strategy_names
from tests.test_cli import step_1_loss

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "tiny_csbp.py")  # L = 128, B = 8
YARN = json.dumps(dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))


def test_local_layers_take_their_own_scaling_else_the_model_s():
  linear = json.dumps(dict(rope_type="linear", factor=8.0))
  m = ModelConfig(head_dim=8, rope_theta=1e6, rope_local_theta=1e4, rope_scaling=linear,
                  layer_pattern="local,global", sliding_window=4)
  plain_local = 1e4 ** -(np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(layer_rope(m, "global", 8)[0], 1e6 ** -(np.arange(0, 8, 2) / 8) / 8,
                             rtol=1e-6)
  np.testing.assert_allclose(layer_rope(m, "local", 8)[0], plain_local / 8, rtol=1e-6)
  m.rope_local_scaling = '{"rope_type": "default"}'
  np.testing.assert_allclose(layer_rope(m, "local", 8)[0], plain_local, rtol=1e-6)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
  assert rope.frequencies(YARN, 1e4, 8)[1] == pytest.approx(0.1 * np.log(4.0) + 1)
  explicit = json.dumps({**json.loads(YARN), "attention_factor": 0.5})
  assert rope.frequencies(explicit, 1e4, 8)[1] == 0.5


@pytest.mark.parametrize("sets, message", [
    (['model.rope_scaling={"rope_type": "ntk", "factor": 2}'],
     r"model.rope_scaling has rope_type='ntk'; bdlm_jax implements \['default', 'linear', "
     r"'dynamic', 'yarn', 'longrope', 'llama3'\]"),
    (['model.rope_scaling={"rope_type": "linear", "factor": 0}'],
     r"model.rope_scaling has factor=0; it must be a number > 0"),
    (['model.rope_local_scaling={"rope_type": "yarn", "factor": 4}'],
     r"model.rope_local_scaling \(rope_type 'yarn'\) needs original_max_position_embeddings"),
    (["model.rope_scaling=yarn"], r"model.rope_scaling.*is not a JSON object"),
    (['model.rope_scaling={"rope_type": "linear", "factor": 2, "rope_theta": 1e6}'],
     r"has the keys \['rope_theta'\], which it does not take: model.rope_theta"),
    (['model.rope_scaling={"rope_type": "longrope", "factor": 4, "long_factor": [1, 2], '
      '"short_factor": [1, 1], "original_max_position_embeddings": 32, "seq_len": 128}'],
     r"has 2 long_factor values; the rotary dim 16 has 8 frequency pairs"),
    (['model.rope_scaling={"rope_type": "dynamic", "factor": 4, '
      '"max_position_embeddings": 32, "seq_len": 64}'],
     r"fixed at seq_len=64, but data.seq_len=128: .* set its seq_len to 128"),
    (["model.head_dim=12", "model.partial_rotary_factor=0.25"],
     r"model.head_dim=12 with model.partial_rotary_factor=0.25 rotates 3 dims, which do not "
     r"split in halves for RoPE"),
    (["model.head_dim=15"], r"model.head_dim=15 must be even for RoPE"),
])
def test_bad_rope_is_a_config_error_at_load(sets, message):
  with pytest.raises(ConfigError, match=message):
    load_config(CONFIG, sets)


@pytest.mark.parametrize("strategy", strategy_names(needs_drafter=False))
def test_every_layout_carries_each_row_s_global_position(strategy):
  """Each rank's rows keep the position of the token they hold: RoPE, scaled or not, is a
  function of that position alone, so every strategy applies it as one device does."""
  seq = 4 if get_strategy(strategy).splits_sequences else 1
  cfg = load_config(CONFIG, [f"parallel.strategy={strategy}", f"parallel.seq={seq}",
                             f"model.rope_scaling={YARN}"])
  tokens = np.random.default_rng(0).integers(0, 250, (2, cfg.data.seq_len))
  batch = make_batch(cfg, tokens)
  held = batch.seg > 0
  np.testing.assert_array_equal(
      batch.tokens[held], np.take_along_axis(tokens, batch.pos, axis=1)[held])
  assert held.sum(1).min() >= cfg.data.seq_len  # every position is held somewhere


def _step1_loss(workdir, *sets) -> float:
  return step_1_loss(CONFIG, workdir, ["train.steps=1", "train.log_every=1",
                                       "train.batch_size=2", "model.n_layers=1",
                                       f"model.rope_scaling={YARN}", *sets])


@pytest.mark.slow
def test_a_scaled_rope_model_gives_one_step_1_loss_under_every_strategy(tmp_path):
  """YaRN (frequencies and attention factor) at L = 128, 4x its original 32 positions."""
  one = _step1_loss(tmp_path / "none", "parallel.strategy=none", "parallel.seq=1")
  for strategy in strategy_names(needs_drafter=False)[1:]:
    loss = _step1_loss(tmp_path / strategy, f"parallel.strategy={strategy}", "parallel.seq=4")
    assert loss == pytest.approx(one, rel=1e-6), strategy
