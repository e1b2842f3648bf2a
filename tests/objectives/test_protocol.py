"""Every objective speaks the whole protocol of `bdlm_jax.objectives`, so that the loss,
layouts, sampler, eval and metrics read it and never branch on an objective's name."""

import pathlib
import re

import pytest

from bdlm_jax.config import OBJECTIVES, ObjectiveConfig
from bdlm_jax.objectives import get_objective

PROTOCOL = ("LOSS_SLOT", "NOISY_STREAM", "COPIES", "TOKEN_SHIFT", "DRAFTER", "logical_rows",
            "corrupt", "score", "evaluated")


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_provides_the_protocol(name):
  objective = get_objective(name)
  missing = [attr for attr in PROTOCOL if not hasattr(objective, attr)]
  assert not missing, f"{name} lacks {missing}"
  assert objective.LOSS_SLOT in ("noisy", "clean", "all") and objective.COPIES >= 1
  assert isinstance(objective.evaluated(ObjectiveConfig(), 1e-3), dict)


def test_no_module_outside_the_objectives_branches_on_an_objective_name():
  package = pathlib.Path(__file__).parents[2] / "bdlm_jax"
  branches = [f"{path.relative_to(package)}: {line.strip()}"
              for path in package.rglob("*.py") if "objectives" not in path.parts
              for line in path.read_text().splitlines()
              if re.search(r"objective\.name\s*(==|!=|in\b)", line)]
  assert not branches, branches
