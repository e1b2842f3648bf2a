"""Parameters as a plain pytree, and the model rebuilt around them at the jit boundary."""

import dataclasses
import functools
import json

import jax
from flax import nnx, traverse_util

from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.models.drafter import DFlash, drafter_args, target_layer_ids
from bdlm_jax.models.transformer import STACKS, Transformer
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel.zero3 import zero3_shardings


def _model_args(cfg: Config) -> tuple:
  """Hashable, JSON-able arguments of `_build`: the model configs and a drafter's context
  width (in target layers), or no drafter. With precomputed features (`drafter.features`)
  the target has no layers: only the embedding, final norm and head the drafter shares."""
  if not get_objective(cfg.objective.name).DRAFTER:
    return _json(cfg.model), "", 0
  target = dataclasses.replace(cfg.model, n_layers=0) if cfg.drafter.features else cfg.model
  return (_json(target), json.dumps(drafter_args(cfg), sort_keys=True),
          len(target_layer_ids(cfg)))


def _json(model: ModelConfig) -> str:
  return json.dumps(dataclasses.asdict(model), sort_keys=True)


def _build(model_json: str, drafter_json: str, n_features: int, rngs: nnx.Rngs):
  """The model of a config: a `Transformer`, or a drafter objective's `DFlash`."""
  model = ModelConfig(**json.loads(model_json))
  if not drafter_json:
    return Transformer(model, rngs=rngs)
  return DFlash(model, json.loads(drafter_json), n_features, rngs)


@functools.lru_cache(maxsize=16)
def _graph(*args):
  return nnx.split(nnx.eval_shape(lambda: _build(*args, nnx.Rngs(0))))


def _graph_of(cfg: Config):
  return _graph(*_model_args(cfg))


# The parameters of an MoE router (under a layer's "mlp"): its projection, and with
# `model.moe_router_norm` its input scale and per-expert output scale (Gemma 4's router.proj,
# router.scale, router.per_expert_scale).
ROUTER_LEAVES = (("router", "kernel"), ("router_scale",), ("expert_scale",))


def frozen_groups(cfg: Config) -> tuple[str, ...]:
  """`train.freeze`, or with "auto" the objective's default (routers for diffusiongemma)."""
  groups = cfg.train.freeze
  groups = get_objective(cfg.objective.name).FREEZE if groups == "auto" else groups
  return tuple(g for g in groups.split(",") if g)


def is_frozen(cfg: Config, path: tuple) -> bool:
  """Whether the parameter at `path` (keys into the params pytree) gets no gradient and no
  optimiser state: a drafter's target, and the groups of `frozen_groups`."""
  if path[0] in get_objective(cfg.objective.name).FROZEN:
    return True
  return "routers" in frozen_groups(cfg) and any(
      len(path) > len(leaf) and path[-len(leaf) - 1:] == ("mlp", *leaf) for leaf in ROUTER_LEAVES)


def split_frozen(cfg: Config, params) -> tuple[dict, dict]:
  """(trainable, frozen) parts of `params` (nested dicts of the same keys; `join` undoes it)."""
  flat = traverse_util.flatten_dict(params)
  parts = ({}, {})
  for path, x in flat.items():
    parts[is_frozen(cfg, path)][path] = x
  return tuple(traverse_util.unflatten_dict(p) for p in parts)


def join(trainable: dict, frozen: dict) -> dict:
  """The params pytree of its (trainable, frozen) parts."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(trainable),
                                       **traverse_util.flatten_dict(frozen)})


def abstract_params(cfg: Config):
  """ShapeDtypeStructs of the params pytree."""
  return nnx.to_pure_dict(_graph_of(cfg)[1])


def transformer_params(model: ModelConfig):
  """ShapeDtypeStructs of a plain `Transformer` of `model` (what a Hugging Face folder holds;
  a drafter's target)."""
  return nnx.to_pure_dict(_graph(_json(model), "", 0)[1])


def shared_weights(target_params: dict) -> dict:
  """A target's weights that its drafter reads (embedding, final norm, LM head): all but the
  layer stacks, which precomputed features (`drafter.features`) stand in for."""
  return {k: v for k, v in target_params.items() if k not in STACKS}


def merge_transformer(model: ModelConfig, params) -> Transformer:
  """The plain `Transformer` of `model` holding `params` (a drafter's target on its own)."""
  return _merge(_graph(_json(model), "", 0), params)


def merge(cfg: Config, params) -> nnx.Module:
  """The model module holding `params` (a pure dict pytree): a `Transformer`, or a drafter
  objective's `DFlash`; cheap, usable under jit."""
  return _merge(_graph_of(cfg), params)


def _merge(graph, params) -> nnx.Module:
  graphdef, state = graph
  state = jax.tree.map(lambda x: x, state)  # a fresh copy: replace_by_pure_dict mutates
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def init_params(cfg: Config, key, mesh=None):
  """Same values on every mesh (drawn from `key` alone); only their placement differs."""
  args = _model_args(cfg)

  def init(key):
    return nnx.to_pure_dict(nnx.state(_build(*args, nnx.Rngs(params=key))))

  if mesh is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=zero3_shardings(mesh, abstract_params(cfg),
                                                      cfg.parallel.expert_axis_names))(key)
