"""The training loop: data -> layout -> jitted step -> metrics and checkpoints, resumable."""

import collections
import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
import warnings

import jax
import numpy as np
from etils import epath
from tqdm import tqdm

from bdlm_jax.checkpoint import CheckpointError, Checkpointer
from bdlm_jax.checkpoint.manager import (COMMIT_MARKER, MANIFEST, DamagedCheckpoint,
                                         trajectory_changes, verify_manifest, workdir_path,
                                         write_manifest)
from bdlm_jax.checkpoint.hf_drafter import load_drafter
from bdlm_jax.checkpoint.hf_export import export_checkpoint
from bdlm_jax.checkpoint.hf_names import hf_model_type
from bdlm_jax.checkpoint.hf_import import params_from_hf
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.config import Config
from bdlm_jax.configure import PRETRAIN_NAMES, pretrain_stage, replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.evaluate import HeldOut
from bdlm_jax.feed import Feed
from bdlm_jax.kernels import COMPILED_ON, interpreted
from bdlm_jax.metrics import MetricsWriter, model_flops_per_step, peak_flops, peak_memory_bytes
from bdlm_jax.models.drafter import FROZEN, TRAINED
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import init_params
from bdlm_jax.parallel.experts import check_dispatch_runs_here
from bdlm_jax.parallel.mesh import initialize_distributed, make_mesh
from bdlm_jax.train import (MAX_UPDATE_RATIO, abstract_state, init_state, is_finite,
                             make_train_step)


# A checkpoint holds the state after a step, so that state is what is judged: train_step
# applies a step only if the state it gives is finite and its update is within
# train.MAX_UPDATE_RATIO of the weights, and a state is checkpointed only if none of its
# step's JUDGED metrics (the loss, ||update|| / ||weights||, ||weights||) is a spike: over
# SPIKE_FACTOR x the median of that metric over the last SPIKE_WINDOW applied steps (once there
# are SPIKE_MIN of them). So a diverging run (finite but ever larger losses or weights) does
# not rotate its good checkpoints out. Spikes count in the median, so a level that lasts over
# half the window becomes the new normal.
SPIKE_FACTOR = 3.0
SPIKE_WINDOW = 50
SPIKE_MIN = 10
JUDGED = ("loss", "update_ratio", "param_norm")
# A first stage's export (`export_stage`) records the step it holds in this file.
EXPORTED_FROM = "exported_from.json"
GOOD = (f"finite; its loss, update/weight ratio and weight norm within {SPIKE_FACTOR:g}x the "
        f"median of the recent steps")


class BadStepsError(RuntimeError):
  """`train.max_bad_steps` steps in a row had a non-finite loss, gradient or update, or an
  update over train.MAX_UPDATE_RATIO."""


class Interrupted(KeyboardInterrupt):
  """Training stopped on SIGINT or SIGTERM; the message says what was saved."""

  def __init__(self, message: str, signum: int = signal.SIGINT):
    super().__init__(message)
    self.signum = signum


class SpikeDetector:
  """Tells whether each applied step's value of one metric is a spike (see SPIKE_FACTOR)."""

  def __init__(self):
    self._recent = collections.deque(maxlen=SPIKE_WINDOW)
    self.median = math.inf  # of the losses the last one was compared with

  def __call__(self, value: float) -> bool:
    enough = len(self._recent) >= SPIKE_MIN
    self.median = float(np.median(self._recent)) if enough else math.inf
    self._recent.append(value)
    return value > SPIKE_FACTOR * self.median


@contextlib.contextmanager
def stop_requests():
  """Turns the first SIGINT or SIGTERM (a scheduler's preemption) into a request, read
  between steps: `requests` holds the signal numbers received. A second signal interrupts at
  once. Only in the main thread of a single-process run; multi-host runs leave preemption to
  Orbax (PreemptionCheckpointingPolicy), which saves on every host at the same step."""
  requests = []
  if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
    yield requests
    return
  signals = (signal.SIGINT, signal.SIGTERM)
  previous = {s: signal.getsignal(s) for s in signals}

  def on_signal(signum, frame):
    if requests:
      raise Interrupted(f"{signal.Signals(signum).name} twice: stopped without saving", signum)
    requests.append(signum)

  for s in signals:
    signal.signal(s, on_signal)
  try:
    yield requests
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def train(cfg: Config, workdir: str, resume: bool | str = False, progress: bool = True,
          allow_changes: bool = False, key_names: dict | None = None) -> list[dict]:
  """Trains `cfg.train.steps` steps; returns the logged metrics. Resumes from `workdir`.

  `resume`: False refuses a workdir that already holds checkpoints, True one that holds none
  (a mistyped workdir), both before anything is written to it; "if_present" resumes where
  there is a checkpoint and starts afresh where there is none (a preemptible job that reruns
  one command). A resumed run refuses settings that change what it computes from here on
  (`trajectory_changes`: train.steps, which shapes the learning-rate schedule, the batch, the
  data, the seed...) unless `allow_changes`, which warns naming them. If training stops early
  (an error, Ctrl-C), checkpoints already started are finished before the exception
  propagates, so `resume` can continue from them. SIGINT or SIGTERM stops the run after the
  step in progress, saving it (if judged good, below) and raising `Interrupted`, whose
  message names the checkpoint to resume from, if any. A checkpoint whose background save
  failed stops the run at the next step with a CheckpointError naming it and the cause; a
  resumed state that is not finite (damaged, and saved before checkpoints had checksums) is
  refused before any step.

  A step that `train_step` skips (a non-finite loss, gradient or update, or an update over
  MAX_UPDATE_RATIO x the weights) is counted in the logged `skipped_steps` and gets no regular
  checkpoint (the final one is still written); `train.max_bad_steps` in a row raise
  `BadStepsError`, naming the last good checkpoint. A step with a spike in a JUDGED metric
  (SPIKE_FACTOR) is applied but its state is not checkpointed, until a step without one.

  Every `train.eval_every` steps and at the last step, the held-out metrics of evaluate.py
  join that step's row.

  With `pretrain.objective` the run has a first stage (`after_pretraining`), trained or
  resumed first, or skipped once finished; the history is the second stage's. `key_names`:
  what `cfg`'s keys are called in the config the user set, for messages (a first stage's).
  """
  initialize_distributed(cfg)
  if cfg.pretrain.objective:
    cfg = after_pretraining(cfg, workdir, resume, progress, allow_changes)
    resume = "if_present" if resume else False  # the second stage may not have begun
  mesh = make_mesh(cfg)
  check_dispatch_runs_here(cfg)
  say_interpreted(cfg)
  if not key_names:  # a first stage is checked by its run, which must export it
    _say_unexportable(cfg)
  if resume is True and not workdir_path(workdir).exists():
    raise _nothing_to_resume(workdir)
  ckpt = Checkpointer(workdir, cfg, save_every=cfg.train.ckpt_every,
                      max_to_keep=cfg.train.max_to_keep, async_save=cfg.train.async_checkpoint,
                      key_names=key_names)
  writer, handlers = None, contextlib.ExitStack()
  try:
    if not resume and ckpt.latest_step() is not None:
      raise FileExistsError(f"{workdir} already holds checkpoints (latest step "
                            f"{ckpt.latest_step()}); pass --resume or choose a new --workdir")
    if resume is True and ckpt.latest_step() is None:
      raise _nothing_to_resume(workdir, ckpt.uncommitted_steps())
    ckpt.remove_unfinished_saves()  # the workdir is ours to write
    if ckpt.latest_step() is None:
      _set_aside_uncommitted(ckpt)  # a new run would write those steps again
    data = Feed(cfg, mesh)
    init_key, step_key = jax.random.split(jax.random.key(cfg.seed))
    good = None  # the newest checkpoint known good: verified at restore, or saved by this run
    if resume and ckpt.latest_step() is not None:
      start, state, data_state = ckpt.restore(abstract_state(cfg, mesh))
      if not is_finite(state):  # no run saves such a state: it must not be saved again
        raise CheckpointError(
            f"checkpoint {ckpt.step_dir(start)} holds weights or optimiser moments that are "
            f"not finite, which no run saves: it is damaged, and not resumed; move it aside "
            f"(e.g. to {ckpt.step_dir(start)}.corrupt) to resume from an older one")
      _check_same_run(ckpt, start, cfg, allow_changes)
      _check_not_past_the_end(ckpt, start, cfg)
      good = start if ckpt.restored_verified else None
      data.set_state(data_state)
    else:
      start, state = 0, init_state(cfg, init_key, mesh, starting_params(cfg, init_key, mesh))
    train_step = make_train_step(cfg, mesh)
    held_out = HeldOut(cfg, mesh) if cfg.train.eval_every else None
    writer = MetricsWriter(ckpt.workdir, start)
    flops, peak = model_flops_per_step(cfg), peak_flops(cfg)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    history = []
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not progress or jax.process_index())
    handlers.callback(bar.close)  # ends its line, so that an error prints on a line of its own
    last_time, last_step = time.perf_counter(), start
    bad_in_a_row = skipped_since_row = 0
    said_cut = False
    is_spike = {name: SpikeDetector() for name in JUDGED}
    good_state = start > 0  # a restored checkpoint, or a state judged good (GOOD) since
    requests = handlers.enter_context(stop_requests())  # until the finally below
    for step in range(start, cfg.train.steps):
      key = jax.random.fold_in(step_key, step)  # also draws a drafter's anchors (make_batch)
      state, metrics = train_step(state, data.next(key), key)
      done = step + 1
      skipped = int(metrics.pop("skipped"))  # waits for the step: its state may be saved below
      spikes = [] if skipped else [name for name in JUDGED  # each detector sees every step
                                   if is_spike[name](float(metrics[name]))]
      if not skipped:  # a skipped step leaves the state, and its judgement, as they were
        good_state = not spikes
      bad_in_a_row = bad_in_a_row + 1 if skipped else 0
      skipped_since_row += skipped
      if not said_cut and (cut := data.truncations.peek())["truncated_examples"]:
        said_cut = True  # once, in the run's first lines when every example is long
        _say_truncated(cut, cfg)
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
                   peak_memory_bytes=peak_memory_bytes(), skipped_steps=skipped_since_row,
                   **data.truncations.take())
        if evaluate:
          row.update(held_out(state.params))
          last_time = time.perf_counter()  # the eval is not step time
        skipped_since_row = 0
        history.append(row)
        writer.write(done, {k: v for k, v in row.items() if k != "step"})
        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
      bar.update(1)
      ckpt.poll()  # a save that failed in the background stops the run here
      if bad_in_a_row == cfg.train.max_bad_steps:
        ckpt.wait()  # raises if the last save failed: then it is not named good
        raise BadStepsError(
            f"steps {done - bad_in_a_row + 1}-{done} had a non-finite loss, gradient or "
            f"update, or an update over {MAX_UPDATE_RATIO:g}x the weights "
            f"(train.max_bad_steps={cfg.train.max_bad_steps} in a row); stopped at step "
            f"{done}. {_last_good(ckpt, good, start)}")
      final = done == cfg.train.steps
      if spikes and (final or done % cfg.train.ckpt_every == 0):
        name = spikes[0]
        warnings.warn(f"step {done}: {name} {float(metrics[name]):.4g} is over "
                      f"{SPIKE_FACTOR:g}x the median {is_spike[name].median:.4g} of the recent "
                      f"steps; not checkpointed")
      # Only a state judged good is saved. A skipped step changed nothing: a regular save
      # would only rotate out an older checkpoint; the final save is forced.
      if good_state and (final or not skipped):
        if ckpt.save(done, state, data.get_state(), force=final):
          good = done
      if requests:  # save the step reached, unless it is saved or not judged good
        if good_state and ckpt.save(done, state, data.get_state(), force=True):
          good = done
        name = signal.Signals(requests[0]).name
        raise Interrupted(f"{name} at step {done}", requests[0])
    return history
  except KeyboardInterrupt as e:
    raise _interrupted(ckpt, workdir, e) from None
  finally:
    handlers.close()
    ckpt.wait()
    ckpt.close()
    if writer is not None:
      writer.close()


def pretrain_dir(workdir: str) -> str:
  """Where a run's first stage (`pretrain.*`) keeps its checkpoints and metrics."""
  return os.path.join(workdir, "pretrain")


def after_pretraining(cfg: Config, workdir: str, resume: bool | str = False,
                      progress: bool = True, allow_changes: bool = False) -> Config:
  """Trains the first stage of `cfg` (`pretrain_stage`) into `pretrain_dir(workdir)`, or
  resumes it where `resume` says, and exports it in Hugging Face format to its `hf` folder;
  returns the second stage: `cfg` starting from there (`init_from`).

  Stage 1 is finished when that export is whole (its checksums hold) and of step
  `pretrain.steps`; it is then neither trained nor exported again. Otherwise the steps
  missing up to `pretrain.steps` are trained (a damaged step is set aside; a last step
  without checksums is not taken as the end) and the export is of exactly that step. A
  second stage with a checkpoint of its own resumes from it without reading stage 1."""
  if resume is True and not workdir_path(workdir).exists():
    raise _nothing_to_resume(workdir)
  first, folder = pretrain_stage(cfg), pretrain_dir(workdir)
  hf = os.path.join(folder, "hf")
  second = lambda init_from: replace(cfg, init_from=init_from, pretrain=dict(objective=""))
  if resume and (begun := _latest_step(cfg, workdir)) is not None:
    warnings.warn(f"stage 2 resumes from its own checkpoint {workdir_path(workdir) / str(begun)}"
                  f": stage 1 ({folder}) is not read")
    return second(hf if exported_step(hf, verified=False) is not None else "")  # not read
  if not (resume and exported_step(hf) == first.train.steps):
    check_exportable(first)  # before training, not after
    if resume:
      _set_aside_unverified_end(first, folder)
      if _latest_step(first, folder) is None:
        warnings.warn(f"stage 1: {folder} holds no checkpoint and no finished export: training "
                      f"it from step 0")
    train(first, folder, resume="if_present" if resume else False, progress=progress,
          allow_changes=allow_changes, key_names=PRETRAIN_NAMES)
    export_stage(first, folder, hf)
  return second(hf)


def export_stage(first: Config, folder: str, hf: str) -> None:
  """Exports step `train.steps` of a first stage, and only that step, to `hf`: written in a
  temporary folder with `EXPORTED_FROM` and checksums (`write_manifest`), then renamed, so
  that an `hf` folder present is whole."""
  step, tmp = first.train.steps, f"{hf}.tmp"
  if (latest := _latest_step(first, folder)) != step:
    raise CheckpointError(
        f"stage 1 ended with no checkpoint of its last step {step} (its state was not judged "
        f"good: see the warning above; latest {latest}): it is not exported, and stage 2 does "
        f"not start")
  shutil.rmtree(tmp, ignore_errors=True)
  export_checkpoint(replace(first, export=dict(out_dir=tmp, checkpoint_step=step)), folder)
  with open(os.path.join(tmp, EXPORTED_FROM), "w") as f:
    json.dump(dict(step=step, objective=first.objective.name), f)
  write_manifest(epath.Path(tmp))
  shutil.rmtree(hf, ignore_errors=True)
  os.replace(tmp, hf)


def exported_step(hf: str, verified: bool = True) -> int | None:
  """The step a first stage's export `hf` holds, if it is whole (every file as its checksums
  say: each file read; `verified=False` trusts the record alone); None without one."""
  try:
    with open(os.path.join(hf, EXPORTED_FROM)) as f:
      step = json.load(f)["step"]
    return step if not verified or verify_manifest(epath.Path(hf)) else None
  except (OSError, ValueError, KeyError, DamagedCheckpoint):
    return None


def check_exportable(cfg: Config) -> None:
  """Raises ConfigError if no Hugging Face family expresses the model: what a two-stage run
  must export, said before it trains."""
  hf_model_type(cfg.model, None)


def say_interpreted(cfg: Config) -> None:
  """One line where the attention kernel runs in Pallas' interpret mode here."""
  impl, backend = cfg.model.attention_impl, jax.default_backend()
  if interpreted(impl, backend):
    warnings.warn(f"model.attention_impl={impl} runs in Pallas' interpret mode on {backend} "
                  f"(a correctness check, several times slower than attention_impl=xla); it "
                  f"compiles on {COMPILED_ON[impl]}")


def _say_unexportable(cfg: Config) -> None:
  """One line, before training, where mode=export will refuse the model."""
  if get_objective(cfg.objective.name).DRAFTER:
    return
  try:
    check_exportable(cfg)
  except ConfigError as e:
    warnings.warn(f"this model trains, but mode=export will refuse it: {e}")


def _latest_step(cfg: Config, workdir: str) -> int | None:
  """The newest committed checkpoint of `workdir`, unread (None without one)."""
  if not workdir_path(workdir).exists():
    return None
  with Checkpointer(workdir, cfg, save_every=cfg.train.ckpt_every, max_to_keep=1) as ckpt:
    return ckpt.latest_step()


def _set_aside_unverified_end(first: Config, folder: str) -> None:
  """A first stage's last step without checksums (its run stopped between the save and
  them) could be damaged unseen: set aside as `<step>.unverified`, to be trained again."""
  step = _latest_step(first, folder)
  path = workdir_path(folder) / str(step)
  if step == first.train.steps and not (path / MANIFEST).exists():
    path.rename(path.parent / f"{step}.unverified")
    warnings.warn(f"stage 1's last step {path} has no {MANIFEST}: it cannot be verified, so it "
                  f"is not taken as stage 1's end; moved to {path}.unverified, and the steps "
                  f"after the newest checkpoint before it are trained again")


def _check_not_past_the_end(ckpt: Checkpointer, start: int, cfg: Config) -> None:
  """A run resumed past its (lowered) `train.steps` cannot end there: refused, naming it."""
  if start > cfg.train.steps:
    name = ckpt.key_names.get("train.steps", "train.steps")
    was = ckpt.saved_config(start)["train"]["steps"]
    raise ConfigError(
        f"{name}={cfg.train.steps} is below the step {ckpt.step_dir(start)} reached ({start} "
        f"of a schedule of {was} steps): the run cannot end at {cfg.train.steps}; set "
        f"{name}={was} (as trained), or at least {start} with --allow-changes")


def _last_good(ckpt: Checkpointer, good: int | None, start: int) -> str:
  """Names the checkpoint to go back to: only one verified at restore or saved by this run."""
  if good is not None:
    return f"Last good checkpoint: {ckpt.step_dir(good)} (step {good}; {GOOD})"
  if start:
    return (f"No checkpoint is known good: {ckpt.step_dir(start)}, restored unverified (no "
            f"{MANIFEST}), may be the cause; resume from an older step (move it aside) or start "
            f"a new run")
  return "Last good checkpoint: none yet"


def _set_aside_uncommitted(ckpt: Checkpointer) -> None:
  """A run starting from step 0 beside step folders that never committed (saves that never
  finished, or copied in part) moves them to `<step>.corrupt`, saying so."""
  if bad := ckpt.uncommitted_steps():
    ckpt.set_aside([(s, None) for s in bad], "no checkpoint restores: the run starts from "
                   "step 0")


def _say_truncated(cut: dict, cfg: Config) -> None:
  warnings.warn(
      f"{cut['truncated_examples']} of the {cut['examples']} conversations of the latest "
      f"steps are longer than data.seq_len={cfg.data.seq_len}: {cut['prompt_tokens_cut']} "
      f"prompt tokens cut from their left, {cut['response_tokens_cut']} response tokens from "
      f"their end (each keeps its response's start); counted per row of metrics.jsonl "
      f"(truncated_examples, prompt_tokens_cut, response_tokens_cut)")


def _interrupted(ckpt: Checkpointer, workdir: str, e: KeyboardInterrupt) -> Interrupted:
  """`e` with what the workdir now holds: only what is true."""
  ckpt.wait()
  latest = ckpt.latest_step()
  if latest is None:
    held = (f"{workdir} holds no checkpoint (none was due, and no step was judged good): "
            f"rerun without --resume to start again")
  else:
    held = f"latest checkpoint {ckpt.step_dir(latest)} (step {latest}): continue with --resume"
  return Interrupted(f"{e or 'interrupted'}; {held}", getattr(e, "signum", signal.SIGINT))


def _nothing_to_resume(workdir: str, uncommitted: list[int] = ()) -> CheckpointError:
  if uncommitted:
    found = (f"holds no checkpoint to continue from: its step folders "
             f"{', '.join(map(str, uncommitted))} have no {COMMIT_MARKER} (saves that never "
             f"finished, or copied in part), so none restores")
  else:
    found = "holds no checkpoint to continue from (a mistyped --workdir?)"
  return CheckpointError(
      f"--resume: {workdir} {found}; drop --resume to start a new run there (which sets such "
      f"folders aside), or pass --resume-if-present to start one only where there is no "
      f"checkpoint")


def _check_same_run(ckpt: Checkpointer, step: int, cfg: Config, allow_changes: bool) -> None:
  """Refuses, or with `allow_changes` warns about, settings that change the resumed run."""
  changes = (trajectory_changes(ckpt.saved_config(step), cfg, ckpt.key_names) +
             ckpt.data_changes(step))
  if not changes:
    return
  where = ckpt.step_dir(step)
  if not allow_changes:
    raise ConfigError(
        f"checkpoint {where} was trained with " + "; ".join(changes) + ". These change the "
        "run from here on (its learning-rate schedule, batches or data): resume with the "
        "run's settings, or pass --allow-changes to resume with the new ones")
  warnings.warn(f"resuming {where} with changed settings: " + "; ".join(changes))


def starting_params(cfg: Config, key, mesh):
  """A fresh run's weights where they do not come from `key`: a drafter's target (and with
  `drafter.init_from` the published drafter it fine-tunes), a conversion's Hugging Face
  model (`init_from`); None where all of them do."""
  if get_objective(cfg.objective.name).DRAFTER:
    params = dict(init_params(cfg, key, mesh), **{FROZEN: load_target(cfg, mesh)})
    if cfg.drafter.init_from:
      params[TRAINED] = load_drafter(cfg, params[TRAINED])
    return params
  return params_from_hf(cfg, mesh) if cfg.init_from else None  # AR -> BDLM conversion


def default_workdir(config_path: str) -> str:
  return os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])
