"""Every objective speaks the whole typed protocol (`objectives.base.Objective`), so that the
loss, layouts, sampler, eval and metrics read it and never branch on an objective's name
(tests/test_structure.py checks the branching); one registry holds them all."""

import types

import pytest

from bdlm_jax.config import ObjectiveConfig
from bdlm_jax.objectives import OBJECTIVES, base, get_objective, register


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_provides_the_protocol(name):
  objective = get_objective(name)
  assert isinstance(objective, base.Objective)
  assert objective.NAME == name
  assert objective.LOSS_SLOT in ("noisy", "clean", "all") and objective.COPIES >= 1
  assert set(objective.ATTEND_ROWS) <= {"all", "clean", "draft"}
  assert isinstance(objective.evaluated(ObjectiveConfig(), 1e-3), dict)


def test_an_objective_missing_part_of_the_protocol_is_refused_by_name():
  partial = types.SimpleNamespace(NAME="half", LOSS_SLOT="noisy")
  with pytest.raises(TypeError, match="lacks .*'corrupt'"):
    register(partial)
  assert "half" not in OBJECTIVES
