"""The training loop: data -> layout -> jitted step -> metrics and checkpoints, resumable."""

import os
import time

import jax
import numpy as np
from tqdm import tqdm

from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.checkpoint.hf_import import params_from_hf
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.config import Config
from bdlm_jax.evaluate import HeldOut
from bdlm_jax.feed import Feed
from bdlm_jax.metrics import MetricsWriter, model_flops_per_step, peak_flops, peak_memory_bytes
from bdlm_jax.models.drafter import FROZEN
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import init_params
from bdlm_jax.parallel.experts import check_dispatch_runs_here
from bdlm_jax.parallel.mesh import initialize_distributed, make_mesh
from bdlm_jax.train import abstract_state, init_state, make_train_step


class BadStepsError(RuntimeError):
  """`train.max_bad_steps` steps in a row had a non-finite loss, gradient or update."""


def train(cfg: Config, workdir: str, resume: bool = False, progress: bool = True) -> list[dict]:
  """Trains `cfg.train.steps` steps; returns the logged metrics. Resumes from `workdir`.

  Without `resume`, a workdir that already holds checkpoints is refused before anything is
  written to it. If training stops early (an error, Ctrl-C), checkpoints already started are
  finished before the exception propagates, so `resume` can continue from them.

  A step that `train_step` skips (a non-finite loss, gradient or update) is counted in the
  logged `skipped_steps` and gets no regular checkpoint (the final one is still written);
  `train.max_bad_steps` in a row raise `BadStepsError`.

  Every `train.eval_every` steps and at the last step, the held-out metrics of evaluate.py
  join that step's row.
  """
  initialize_distributed(cfg)
  mesh = make_mesh(cfg)
  check_dispatch_runs_here(cfg)
  ckpt = Checkpointer(workdir, cfg, save_every=cfg.train.ckpt_every,
                      max_to_keep=cfg.train.max_to_keep, async_save=cfg.train.async_checkpoint)
  writer = None
  try:
    if not resume and ckpt.latest_step() is not None:
      raise FileExistsError(f"{workdir} already holds checkpoints (latest step "
                            f"{ckpt.latest_step()}); pass --resume or choose a new --workdir")
    ckpt.remove_unfinished_saves()  # the workdir is ours to write
    data = Feed(cfg, mesh)
    init_key, step_key = jax.random.split(jax.random.key(cfg.seed))
    if resume and ckpt.latest_step() is not None:
      start, state, data_state = ckpt.restore(abstract_state(cfg, mesh))
      data.set_state(data_state)
    else:
      if get_objective(cfg.objective.name).DRAFTER:  # a fresh drafter, its target's weights
        params = dict(init_params(cfg, init_key, mesh), **{FROZEN: load_target(cfg, mesh)})
      else:
        params = params_from_hf(cfg, mesh) if cfg.init_from else None  # AR -> BDLM conversion
      start, state = 0, init_state(cfg, init_key, mesh, params)
    train_step = make_train_step(cfg, mesh)
    held_out = HeldOut(cfg, mesh) if cfg.train.eval_every else None
    writer = MetricsWriter(ckpt.workdir, start)
    flops, peak = model_flops_per_step(cfg), peak_flops(cfg)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    history = []
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not progress or jax.process_index())
    last_time, last_step = time.perf_counter(), start
    bad_in_a_row = skipped_since_row = 0
    good_state = start > 0  # a restored state, or one some step of this run has updated
    for step in range(start, cfg.train.steps):
      state, metrics = train_step(state, next(data), jax.random.fold_in(step_key, step))
      done = step + 1
      skipped = int(metrics.pop("skipped"))  # waits for the step: its state may be saved below
      good_state |= not skipped
      bad_in_a_row = bad_in_a_row + 1 if skipped else 0
      skipped_since_row += skipped
      evaluate = held_out is not None and (done % cfg.train.eval_every == 0
                                           or done == cfg.train.steps)
      if done % cfg.train.log_every == 0 or done == cfg.train.steps or evaluate:
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        step_time = (now - last_time) / (done - last_step)  # the first row includes compiling
        last_time, last_step = now, done
        row = dict(step=done, **{k: float(np.asarray(v)) for k, v in metrics.items()},
                   step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                   mfu=flops / step_time / peak if peak else None,
                   peak_memory_bytes=peak_memory_bytes(), skipped_steps=skipped_since_row)
        if evaluate:
          row.update(held_out(state.params))
          last_time = time.perf_counter()  # the eval is not step time
        skipped_since_row = 0
        history.append(row)
        writer.write(done, {k: v for k, v in row.items() if k != "step"})
        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
      bar.update(1)
      if bad_in_a_row == cfg.train.max_bad_steps:
        ckpt.wait()
        saved = ckpt.latest_step()
        good = f"{ckpt.step_dir(saved)} (step {saved})" if saved is not None else "none yet"
        raise BadStepsError(
            f"steps {done - bad_in_a_row + 1}-{done} had a non-finite loss, gradient or update "
            f"(train.max_bad_steps={cfg.train.max_bad_steps} in a row); stopped at step {done}. "
            f"Last good checkpoint: {good}")
      final = done == cfg.train.steps
      # A skipped step changed nothing: its regular save would only rotate out an older good
      # checkpoint. The final save is forced, unless no step ever applied (the state may be a
      # NaN init_from).
      if not skipped or (final and good_state):
        ckpt.save(done, state, data.get_state(), force=final)
    bar.close()
    return history
  finally:
    ckpt.wait()
    ckpt.close()
    if writer is not None:
      writer.close()


def default_workdir(config_path: str) -> str:
  return os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])
