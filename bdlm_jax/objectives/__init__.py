"""Training objectives: each module speaks the protocol of `base.Objective`, and this is
their one registry, keyed by `objective.name`."""

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import ar, bd3lm, dflash, diffusiongemma, fast_dllm_v2
from bdlm_jax.objectives.base import Objective, protocol_members

OBJECTIVES: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
  """Adds an objective (a module or object with the whole protocol) under its NAME."""
  if not isinstance(objective, Objective):
    missing = [a for a in protocol_members() if not hasattr(objective, a)]
    raise TypeError(f"{objective!r} lacks {missing} of the objective protocol")
  if objective.NAME in OBJECTIVES:
    raise ValueError(f"objective {objective.NAME!r} is registered already")
  OBJECTIVES[objective.NAME] = objective
  return objective


def get_objective(name: str) -> Objective:
  if name not in OBJECTIVES:
    raise ConfigError(f"objective.name={name!r} is not one of {list(OBJECTIVES)}")
  return OBJECTIVES[name]


def check_config(cfg: Config) -> None:
  """The objective's rules, and the [MASK] id inside the vocabulary where it is used."""
  o = cfg.objective
  objective = get_objective(o.name)
  if objective.MASK_TOKEN and not 0 <= o.mask_token_id < cfg.model.vocab_size:
    raise ConfigError(f"objective.mask_token_id={o.mask_token_id} must lie in "
                      f"[0, model.vocab_size={cfg.model.vocab_size})")
  if o.boundary_row != "clean" and not objective.TOKEN_SHIFT:
    raise ConfigError(f"objective.boundary_row={o.boundary_row!r} picks the row that scores a "
                      f"block's first token when row i predicts token i+1 (fast_dllm_v2); "
                      f"objective.name={o.name!r} scores each row on its own token: leave it "
                      f"'clean'")
  objective.check_config(cfg)


def reserved_mask_id(cfg: Config) -> int | None:
  """The id no data may hold: [MASK], for objectives that write it (None otherwise)."""
  return cfg.objective.mask_token_id if get_objective(cfg.objective.name).MASK_TOKEN else None


for _module in (bd3lm, fast_dllm_v2, ar, dflash, diffusiongemma):
  register(_module)
