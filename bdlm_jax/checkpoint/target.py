"""A drafter's frozen target (objective=dflash): the weights `drafter.target` names, a Hugging
Face folder or a workdir of ours, checked against `model.*` before anything compiles."""

from __future__ import annotations

import dataclasses
import os

from bdlm_jax.checkpoint.hf_import import params_from_hf
from bdlm_jax.checkpoint.hf_names import shape_fields
from bdlm_jax.checkpoint.manager import Checkpointer, restore_state
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import shared_weights


def load_target(cfg: Config, mesh) -> dict:
  """Params of the target (a `Transformer` of `cfg.model`), placed on `mesh`; with
  precomputed features (`drafter.features`) only the weights its drafter shares (embedding,
  final norm, LM head): the folder is still checked against the whole of `model.*`."""
  path = cfg.drafter.target
  if not path:
    raise ConfigError("objective=dflash trains a drafter for a frozen target: set "
                      "drafter.target to a Hugging Face folder or a workdir of ours")
  if not os.path.isdir(path):
    raise ConfigError(f"drafter.target={path!r} does not exist")
  layers = not cfg.drafter.features
  if any(f.endswith(".safetensors") for f in os.listdir(path)):
    return params_from_hf(replace(cfg, init_from=path), mesh, layers)
  params = _from_workdir(cfg, path, mesh)
  return params if layers else shared_weights(params)


def _from_workdir(cfg: Config, workdir: str, mesh) -> dict:
  """The params of the latest checkpoint of one of our runs, restored with the config it was
  saved with (only the mesh is ours). The whole target is restored, also when only its
  shared weights are kept: this route loads it once, on the mesh."""
  with Checkpointer(workdir, cfg, save_every=1, max_to_keep=1, async_save=False) as ckpt:
    step = ckpt.latest_step()
    if step is None:
      raise ConfigError(f"drafter.target={workdir!r} holds neither *.safetensors (a Hugging "
                        f"Face folder) nor a checkpoint of ours")
    saved = ckpt.saved_config(step)
  name = saved.get("objective", {}).get("name")
  if name and get_objective(name).DRAFTER:  # its params hold a target of their own
    raise ConfigError(f"drafter.target={workdir!r} holds a drafter (objective.name={name!r}), "
                      f"not a target model: point it at the target's Hugging Face folder or "
                      f"at the workdir of the run that trained the target")
  # Not validated: only the params' shapes and shardings matter here, and the target's own
  # objective may not run under the drafter's strategy.
  target = Config.from_dict(dict(saved, parallel=dataclasses.asdict(cfg.parallel)))
  was, now = shape_fields(target.model), shape_fields(cfg.model)
  wrong = [f"{k} (target {was[k]!r}, config {now.get(k)!r})" for k in was if was[k] != now.get(k)]
  if wrong:
    raise ConfigError(f"drafter.target={workdir} does not fit model.*: {'; '.join(wrong)}")
  return restore_state(target, workdir, mesh)[1].params
