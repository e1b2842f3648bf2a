"""Which kind each layer is: the config's repeating periods laid over the model's depth."""

from bdlm_jax.config import ModelConfig


def layer_types(m: ModelConfig) -> tuple[str, ...]:
  """The attention type, global or local, of every layer."""
  period = m.layer_period
  return tuple(period[i % len(period)] for i in range(m.n_layers))


def mlp_types(m: ModelConfig) -> tuple[str, ...]:
  """The MLP kind, dense or moe, of every layer."""
  period = m.mlp_period
  return tuple(period[i % len(period)] for i in range(m.n_layers))
