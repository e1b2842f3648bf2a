"""Loading a config: parse it, let each section check its own fields, then run the rules
that join sections where they live (the objective's, the strategy's layout, the mesh's,
expert parallelism's). Everything that can fail without devices or data fails here, at
load time, with a message that names the key."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import traceback
from typing import Iterable

from bdlm_jax import objectives
from bdlm_jax.config import Config, apply_overrides, updated
from bdlm_jax.errors import ConfigError
from bdlm_jax.models import rope
from bdlm_jax.parallel import experts, mesh, recurrence, registry
from bdlm_jax.parallel.registry import plan_for


def validate(cfg: Config) -> None:
  """Checks every rule that can be checked without devices or data."""
  cfg.validate()
  objective = objectives.get_objective(cfg.objective.name)
  strategy = registry.get_strategy(cfg.parallel.strategy)
  objectives.check_config(cfg)
  if not strategy.splits_sequences and cfg.parallel.seq != 1:
    raise ConfigError(
        f"parallel.strategy={strategy.name!r} needs parallel.seq=1 (got {cfg.parallel.seq}); "
        f"pick one that splits sequences, such as csbp_ring")
  if strategy.needs_drafter and not objective.DRAFTER:
    raise ConfigError(
        f"parallel.strategy={strategy.name!r} replicates a drafter's draft blocks and cannot "
        f"run the {cfg.objective.name!r} objective, which trains no drafter; use one of "
        f"{list(registry.strategy_names(needs_drafter=False))}")
  if strategy.needs_noisy_stream and not objective.NOISY_STREAM:
    raise ConfigError(
        f"parallel.strategy={strategy.name!r} splits corrupted blocks and cannot run the "
        f"{cfg.objective.name!r} objective, which has no corrupted stream; use one of "
        f"{list(registry.strategy_names(needs_noisy_stream=False))}")
  if (cfg.parallel.draft_transport == "query" and strategy.travels != "none"
      and not (objective.DRAFTER and strategy.travels == "clean")):
    raise ConfigError(
        f"parallel.draft_transport='query' rotates a drafter's draft queries past a context "
        f"that stays: it needs a drafter objective and a strategy that moves only the context "
        f"({list(registry.strategy_names(travels='clean'))}); got objective="
        f"{cfg.objective.name!r}, parallel.strategy={strategy.name!r}. Use 'auto' or 'kv'")
  mesh.check_config(cfg)
  experts.check_config(cfg)
  recurrence.check_config(cfg)
  rope.check_config(cfg.model, cfg.data.seq_len)
  plan_for(cfg)  # the layout (block count vs ranks, divisibility) fails here, not at a batch
  if cfg.pretrain.objective:
    _check_pretrain(cfg)


def _check_pretrain(cfg: Config) -> None:
  if cfg.pretrain.objective not in objectives.OBJECTIVES:
    raise ConfigError(f"pretrain.objective={cfg.pretrain.objective!r} is not one of "
                      f"{['', *objectives.OBJECTIVES]}")
  first = objectives.get_objective(cfg.pretrain.objective)
  if cfg.init_from:
    raise ConfigError(f"init_from={cfg.init_from!r} and pretrain.objective="
                      f"{cfg.pretrain.objective!r} both say where training starts: set one")
  if first.DRAFTER or objectives.get_objective(cfg.objective.name).DRAFTER:
    raise ConfigError("pretrain.objective trains a model that the run continues; a drafter "
                      "run starts from its frozen target instead (drafter.target)")
  pretrain_stage(cfg)  # the first stage's own rules


# A first stage's keys (`pretrain_stage`) as the user sets them, for its messages.
PRETRAIN_NAMES = {"objective.name": "pretrain.objective", "train.steps": "pretrain.steps",
                  "train.lr": "pretrain.lr"}


def pretrain_stage(cfg: Config) -> Config:
  """The first stage of a run with `pretrain.objective`: the same model and data, that
  objective for `pretrain.steps` at `pretrain.lr`, evaluated at its end (where the run
  evaluates), no stage of its own."""
  p, t = cfg.pretrain, cfg.train
  return replace(cfg, objective=dict(name=p.objective), pretrain=dict(objective=""),
                 train=dict(steps=p.steps, lr=p.lr, eval_every=p.steps if t.eval_every else 0,
                            ckpt_every=min(t.ckpt_every, p.steps)))


def override(cfg: Config, overrides: Iterable[str] = ()) -> Config:
  """Returns a copy of `cfg` with `a.b=c` overrides applied and validated."""
  out = _with_served_drafter(apply_overrides(cfg, overrides))
  validate(out)
  return out


def replace(cfg: Config, **sections: dict) -> Config:
  """Functional update by section, validated: replace(cfg, model=dict(n_layers=4))."""
  out = _with_served_drafter(updated(cfg, **sections))
  validate(out)
  return out


def _with_served_drafter(cfg: Config) -> Config:
  """`cfg` with the settings of the served drafter `drafter.init_from` names, if any."""
  if not cfg.drafter.init_from:
    return cfg
  if not objectives.get_objective(cfg.objective.name).DRAFTER:
    raise ConfigError(f"drafter.init_from={cfg.drafter.init_from!r} starts a drafter; "
                      f"objective={cfg.objective.name!r} trains none")
  from bdlm_jax.checkpoint.hf_drafter import served_settings
  return updated(cfg, **served_settings(cfg))


def load_config(path: str, overrides: Iterable[str] = ()) -> Config:
  """Loads `get_config()` from a Python file, then applies `overrides`."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location("_bdlm_config", path)
  module = importlib.util.module_from_spec(spec)
  with _config_file_errors(path):
    spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} does not define get_config()")
  with _config_file_errors(path):
    cfg = module.get_config()
  if isinstance(cfg, dict):
    cfg = Config.from_dict(cfg)
  if not isinstance(cfg, Config):
    raise ConfigError(f"get_config() in {path} must return a bdlm_jax Config, got {type(cfg)}")
  return override(cfg, overrides)


@contextlib.contextmanager
def _config_file_errors(path: str):
  """A config file that fails to run (a typo, a bad import) is a ConfigError naming the file
  and line, so the CLI reports it in one line instead of a traceback."""
  try:
    yield
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, SyntaxError):
      line, text = e.lineno, e.msg
    else:
      frames = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                if os.path.abspath(f.filename) == os.path.abspath(path)]
      line, text = (frames[-1] if frames else None), str(e)
    where = f"{path}, line {line}" if line else path
    raise ConfigError(f"config file {where} raised {type(e).__name__}: {text}") from e
