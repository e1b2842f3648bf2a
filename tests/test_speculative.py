"""Speculative decoding with a drafter (bdlm_jax/speculative.py): the output is the target's
own greedy decoding token for token, with the tiny DFlash2 drafter (at random: it rarely
agrees) and with stand-in drafters that propose the target's continuation right up to a
chosen slot (so every acceptance length is taken); the forwards counted are those made."""

import functools

import pytest

from bdlm_jax import ConfigError
from bdlm_jax.configure import replace
from bdlm_jax.speculative import Speculator
from tests.objectives.test_dflash import B
from tests.objectives.test_dflash2 import _cfg2, _params

PROMPT, NEW = [5, 17, 42, 8, 99, 3], 12


@functools.cache
def _speculator():
  cfg = _cfg2()
  return Speculator(_params(cfg), cfg)


@functools.cache
def _greedy():
  return _speculator().greedy(PROMPT, NEW + B).tokens


def test_drafted_and_verified_tokens_are_the_targets_greedy_ones():
  out = _speculator().decode(PROMPT, NEW)
  assert out.tokens == _greedy()[:NEW]
  assert out.target_forwards == len(out.accepted) + 1
  assert 1.0 <= out.acceptance_length <= B


@pytest.mark.parametrize("right", [0, 1, B - 1])
def test_each_verification_keeps_the_agreeing_prefix_and_the_targets_token(right, monkeypatch):
  """A drafter right for its first `right` proposals: each forward yields right + 1 tokens."""
  spec, greedy = _speculator(), _greedy()

  def draft(tokens, feats):
    done = len(tokens) - len(PROMPT)
    proposals = greedy[done:done + B - 1]
    return proposals[:right] + [(t + 1) % 250 for t in proposals[right:]]

  monkeypatch.setattr(spec, "_draft", draft)
  out = spec.decode(PROMPT, NEW)
  assert out.tokens == greedy[:NEW]
  assert out.accepted == [right] * len(out.accepted)
  assert out.target_forwards == 1 + -(-(NEW - 1) // (right + 1))


def test_a_run_on_precomputed_features_cannot_decode():
  cfg = replace(_cfg2(), drafter=dict(features="precomputed"))
  with pytest.raises(ConfigError, match="drafter.features"):
    Speculator({}, cfg)  # refused before its weights are read
