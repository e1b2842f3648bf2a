"""Training objectives: each turns logical tokens into supervised rows and scores logits."""

from bdlm_jax.config import ConfigError
from bdlm_jax.objectives import ar, bd3lm, fast_dllm_v2

_OBJECTIVES = {"bd3lm": bd3lm, "fast_dllm_v2": fast_dllm_v2, "ar": ar}


def get_objective(name: str):
  if name not in _OBJECTIVES:
    raise ConfigError(f"unknown objective.name {name!r}; valid: {sorted(_OBJECTIVES)}")
  return _OBJECTIVES[name]
