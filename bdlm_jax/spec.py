"""The config resolved once: what a step decided from it, built before tracing.

`resolve(cfg, mesh)` looks up the layout plan, the objective, the attention functions and
the expert dispatch once; the traced loss closes over the result, so no traced function
reads the config to decide anything again (big_vision and nanodo do the same).
"""

import dataclasses
from typing import Any, Callable

import jax

from bdlm_jax.config import Config
from bdlm_jax.objectives import get_objective
from bdlm_jax.objectives.base import Objective
from bdlm_jax.parallel.experts import expert_dispatch
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.registry import plan_for
from bdlm_jax.parallel.rows import row_runner
from bdlm_jax.parallel.strategies import make_attend


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
  cfg: Config
  mesh: Any  # jax.sharding.Mesh, or None on one device
  plan: LayoutPlan
  objective: Objective
  attend: dict[str, Callable]  # `make_attend(rows=...)` of each of the objective's ATTEND_ROWS
  dispatch: Callable | None  # the MoE layers' expert dispatch (None: run where the rows are)
  rows: Callable  # how a layer runs its row-wise work in parts (models.transformer.RowsFn)

  def rows_sharded(self, x):
    """`x` [S, R, ...] constrained to the batch's row sharding (a no-op on one device)."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, row_sharding(self.mesh))


def resolve(cfg: Config, mesh=None) -> StepSpec:
  """Everything a step reads from `cfg` to decide how it runs, looked up once."""
  plan = plan_for(cfg)
  objective = get_objective(cfg.objective.name)
  attend = {rows: make_attend(cfg, mesh, rows, plan) for rows in objective.ATTEND_ROWS}
  return StepSpec(cfg, mesh, plan, objective, attend, expert_dispatch(cfg, mesh),
                  row_runner(mesh))
