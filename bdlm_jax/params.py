"""Parameters as a plain pytree, and the model rebuilt around them at the jit boundary."""

import dataclasses
import functools
import json

import jax
from flax import nnx

from bdlm_jax.config import Config, ModelConfig, expert_axes
from bdlm_jax.models.transformer import Transformer
from bdlm_jax.parallel.zero3 import zero3_shardings


@functools.lru_cache(maxsize=16)
def _graph(model_json: str):
  model_cfg = ModelConfig(**json.loads(model_json))
  abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def _graph_of(cfg: Config):
  return _graph(json.dumps(dataclasses.asdict(cfg.model), sort_keys=True))


def abstract_params(cfg: Config):
  """ShapeDtypeStructs of the params pytree."""
  return nnx.to_pure_dict(_graph_of(cfg)[1])


def merge(cfg: Config, params) -> Transformer:
  """The model module holding `params` (a pure dict pytree); cheap, usable under jit."""
  graphdef, state = _graph_of(cfg)
  state = jax.tree.map(lambda x: x, state)  # a fresh copy: replace_by_pure_dict mutates
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def init_params(cfg: Config, key, mesh=None):
  """Same values on every mesh (drawn from `key` alone); only their placement differs."""
  def init(key):
    return nnx.to_pure_dict(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(params=key))))

  if mesh is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=zero3_shardings(mesh, abstract_params(cfg),
                                                      expert_axes(cfg.parallel)))(key)
