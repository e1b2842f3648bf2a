"""Checkpointing: a thin wrapper over Orbax's CheckpointManager.

Each step directory `<workdir>/<step>/` holds three items:
  state/   the train-state pytree (params, opt_state, step, rng key data), written by every
           host for the shards it owns and restored straight onto the mesh sharding;
  data/    the Grain iterator state, as JSON (bytes are base64-encoded);
  config/  the resolved Config and the tokenizer's fingerprint, checked against the current
           ones on restore (a different vocabulary or [MASK] id would garble the params),
           and the fingerprint of a prepared data folder (`data.source=tokens`), which a
           resumed run must find unchanged (`data_changes`).

Atomicity comes from Orbax: a step is written to `<step>.orbax-checkpoint-tmp` and renamed
when complete, so a run killed mid-save leaves no step directory. Once a step has committed,
`MANIFEST` records the size and sha256 of each of its files, and restore compares them first:
a file damaged at the same size restores as valid arrays otherwise. A step directory that is
present but unusable anyway (no commit marker, a file that differs from its manifest,
truncated or garbage files) is skipped on restore, with a warning, in favour of the newest
step that restores. A step without a manifest (written before there were any, or by a run
killed between its commit and the next step) restores unverified, with a warning.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
import time
import uuid
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from bdlm_jax.checksums import sha256
from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError, cause, first_line
from bdlm_jax.objectives import get_objective

COMMIT_MARKER = "commit_success.txt"  # Orbax writes it into a step before the final rename.
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # of a step folder Orbax is still writing
MANIFEST = "checksums.json"  # {"files": {path in the step folder: {"size", "sha256"}}}

# Model keys that change how the model runs, not what its parameters mean: a run may resume
# with a different kernel, remat policy, compute dtype or loss chunk.
RUNTIME_MODEL_KEYS = ("attention_impl", "attention_chunk", "remat", "compute_dtype",
                      "logits_chunk", "row_chunks")

# Settings a run may resume with changed (`trajectory_changes`): how it runs, logs and
# checkpoints, not what it computes (every mesh, strategy and micro-batching gives the same
# loss and gradients), and what only other modes or a fresh run read. A section covers its keys.
FREE_ON_RESUME = ("mode", "init_from", "pretrain", "parallel", "sample", "eval", "export", "plan",
                  "prepare", *(f"model.{k}" for k in RUNTIME_MODEL_KEYS), "data.num_threads",
                  "train.grad_accum", "train.log_every", "train.ckpt_every",
                  "train.max_to_keep", "train.async_checkpoint", "train.peak_tflops",
                  "train.max_bad_steps", "train.eval_every")

# Key of the config item that records `Tokenizer.fingerprint`: what the token ids meant.
TOKENIZER_KEY = "tokenizer_fingerprint"
# Key of the config item that records the prepared folder's records (`prepare.fingerprint`):
# the same data.path re-prepared from another corpus is other data.
DATA_KEY = "data_fingerprint"


class CheckpointError(RuntimeError):
  """No usable checkpoint (every candidate step is missing, truncated or corrupt), or a save
  that failed."""


class DamagedCheckpoint(Exception):
  """A step's file differs from what its manifest recorded at save."""


def restore_state(cfg: Config, workdir: epath.PathLike, mesh, step: int = -1):
  """(step, train state) of checkpoint `step` (-1: the latest usable) of `workdir`, on
  `mesh`: what mode=eval, sample and export start from."""
  from bdlm_jax.train import abstract_state  # train builds the step; restoring rarely needs it
  if not workdir_path(workdir).exists():  # a reader does not create the folder it reads
    raise CheckpointError(f"{workdir} does not exist: no checkpoint to restore (train first, "
                          f"or check --workdir)")
  with Checkpointer(workdir, cfg, save_every=cfg.train.ckpt_every,
                    max_to_keep=cfg.train.max_to_keep, async_save=False) as ckpt:
    found, state, _ = ckpt.restore(abstract_state(cfg, mesh), step=step if step >= 0 else None)
  return found, state


class Checkpointer:
  """Saves and restores (state, data iterator state, config) per step under `workdir`, a
  local folder or a URL Orbax can write (`gs://bucket/run`)."""

  def __init__(self, workdir: epath.PathLike, cfg: Config, *, save_every: int,
               max_to_keep: int, async_save: bool = True, key_names: dict | None = None):
    """`key_names`: what `cfg`'s keys are called in the config the user set, for messages
    (a first stage's `train.steps` is `pretrain.steps`: `configure.PRETRAIN_NAMES`)."""
    if save_every < 1 or max_to_keep < 1:
      raise ConfigError(
          f"need save_every >= 1 and max_to_keep >= 1, got {save_every} and {max_to_keep}")
    self.workdir = workdir_path(workdir)
    self.cfg = cfg
    self.key_names = key_names or {}
    self._tokenizer = _tokenizer_fingerprint(cfg)
    self._data = None  # read on the first save or check: readers need no data folder
    _check_writable(self.workdir)
    policy = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        # Not at start-up: a reader (sampling, an evaluator) opening a trainer's workdir would
        # delete its save in flight. The trainer calls `remove_unfinished_saves` instead.
        cleanup_tmp_directories=False,
        # Every `save_every` steps, plus an emergency save when a host is preempted. (Orbax's
        # default would also save the first step it sees, whatever its number.)
        save_decision_policy=policy.AnySavePolicy([
            policy.FixedIntervalPolicy(save_every), policy.PreemptionCheckpointingPolicy()]),
    )
    # Handlers named up front: with `item_names` alone, a fresh manager cannot read the
    # metadata of steps it did not write itself (item_metadata() returns None).
    self._mngr = ocp.CheckpointManager(self.workdir, options=options, item_handlers=dict(
        state=ocp.StandardCheckpointHandler(), data=ocp.JsonCheckpointHandler(),
        config=ocp.JsonCheckpointHandler()))
    self._barriers = 0
    self.restored_verified = False  # whether the last `restore` checked its step's checksums
    self._pending = None  # the step saving in the background, until `_finish_save`
    self._failed = False  # a failed save was raised: Orbax would raise it again on close
    self._orbax_errors = _OrbaxErrors()  # its threads' tracebacks: we raise one line instead
    logging.getLogger("absl").addFilter(self._orbax_errors)
    _quiet_late_reads()  # and writes: those of a failed save call back late too

  def save(self, step: int, state: Any, data_state: Any = None, force: bool = False) -> bool:
    """Starts saving `step` if it is due (or `force`); returns whether it did.

    With async_save the arrays are copied off the devices before this returns and written in
    the background; call `wait()` before reading the files or exiting.
    """
    if step in self._mngr.all_steps():
      return False  # already on disk, e.g. the step we just resumed from
    if not (force or self._mngr.should_save(step)):
      return False
    self.wait()  # Orbax would wait for the previous save too; this also checks and seals it
    started = self._mngr.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(_encode_data_state(data_state)),
        config=ocp.args.JsonSave({**self.cfg.to_dict(), TOKENIZER_KEY: self._tokenizer,
                                  DATA_KEY: self._data_fingerprint()}),
    ))
    if started:
      self._pending = step
    return started

  def poll(self) -> None:
    """Between steps: seals the background save if it has finished; raises CheckpointError
    if it failed, so that a run does not train on for hours with nothing saved."""
    if self._pending is not None and not self._mngr.is_saving_in_progress():
      self.wait()

  def latest_step(self) -> int | None:
    """Newest committed step, or None.

    A step still being written in the background does not count until it commits. Its files
    are only read, and so checked, by `restore`.
    """
    steps = self._committed_steps()
    return steps[0] if steps else None

  def saved_config(self, step: int) -> dict:
    """The config (as a dict, without the fingerprints) `step` was written with."""
    return {k: v for k, v in self._saved(step).items() if k not in (TOKENIZER_KEY, DATA_KEY)}

  def data_changes(self, step: int) -> list[str]:
    """[what changed] if the prepared data folder differs from the one `step` trained on
    (same data.path, re-prepared); checkpoints of other sources, or older ones, pass."""
    was, now = self._saved(step).get(DATA_KEY), self._data_fingerprint()
    if was and now and was != now:
      return [f"data.path={self.cfg.data.path!r} re-prepared: its records differ (folder "
              f"fingerprint {was[:12]} at the checkpoint, {now[:12]} now)"]
    return []

  def _saved(self, step: int) -> dict:
    return self._mngr.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore())).config

  def _data_fingerprint(self) -> str | None:
    if self._data is None and self.cfg.data.source == "tokens" and not self.cfg.data.mixture:
      from bdlm_jax.data.prepare import folder_fingerprint  # late: the data package needs grain
      self._data = folder_fingerprint(self.cfg.data.path)
    return self._data

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, Any]:
    """Returns (step, state, data_state) restored onto the shardings in `abstract_state`.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with `.sharding` set (e.g. from
    `jax.eval_shape` plus the mesh's shardings). With `step=None` the newest step that
    restores is used; unreadable newer steps are skipped with a warning and set aside as
    `<step>.corrupt` so that the resumed run can write those steps again.
    """
    self.wait()
    self._mngr.reload()
    candidates = [step] if step is not None else self._committed_steps()
    if not candidates:
      raise FileNotFoundError(f"no committed checkpoint to restore in {self.workdir}")
    failures = []
    for s in candidates:
      try:
        verified = verify_manifest(self.step_dir(s))
        state, data_state = self._restore_step(s, abstract_state)
      except ConfigError:
        raise  # the current config or state does not fit: an older step would not either
      except Exception as e:  # pylint: disable=broad-except
        if step is not None:
          raise CheckpointError(f"cannot restore checkpoint {self.step_dir(s)}: "
                                f"{first_line(e)}") from e
        failures.append((s, e))
        continue
      if not verified:
        warnings.warn(f"checkpoint {self.step_dir(s)} has no {MANIFEST} (written before "
                      f"checkpoints recorded checksums, or its run stopped right after the "
                      f"save): restored unverified")
      self.restored_verified = verified
      # An older step restored with the same arguments, so the newer ones are truly bad.
      self.set_aside(failures + [(u, None) for u in self.uncommitted_steps()],
                     f"restored {self.step_dir(s)} instead")
      return s, state, data_state
    raise CheckpointError(
        f"no checkpoint in {self.workdir} restores (if all fail alike, check the abstract "
        f"state and mesh):\n" +
        "\n".join(f"  {self.step_dir(s)}: {first_line(e)}" for s, e in failures))

  def remove_unfinished_saves(self) -> None:
    """Deletes the `<step>.orbax-checkpoint-tmp` folders of saves a killed run left unfinished.

    Saving a step again replaces its folder, but an emergency save on preemption is at a step
    no later save repeats. Only the process that trains in `workdir` may call this: a reader
    would delete a save in flight.
    """
    if jax.process_index() == 0:
      for leftover in self.workdir.glob(f"*{TMP_SUFFIX}*"):
        leftover.rmtree()

  def wait(self) -> None:
    """Blocks until the save in flight is on disk, then writes its manifest; call before
    exiting. A failed save raises CheckpointError naming the step, its folder and the cause."""
    step, self._pending = self._pending, None
    if step is None:
      return
    try:
      self._mngr.wait_until_finished()
      if not (self.step_dir(step) / COMMIT_MARKER).exists():  # Orbax logged and went on
        raise RuntimeError(self._orbax_errors.first or "it did not commit")
    except Exception as e:  # pylint: disable=broad-except
      self._failed = True
      latest = self.latest_step()
      kept = (f"the last committed checkpoint is {self.step_dir(latest)} (continue with "
              f"--resume)" if latest is not None else "there is no committed checkpoint")
      raise CheckpointError(f"saving checkpoint step {step} to {self.step_dir(step)} failed: "
                            f"{cause(e)}; stopped; {kept}") from None
    if jax.process_index() == 0:
      write_manifest(self.step_dir(step))

  def close(self) -> None:
    try:
      self._mngr.close()
    except Exception:  # pylint: disable=broad-except
      if not self._failed:  # else already raised, as one line, by `wait`
        raise
    finally:
      logging.getLogger("absl").removeFilter(self._orbax_errors)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------------------------------

  def step_dir(self, step: int) -> epath.Path:
    return self.workdir / str(step)

  def _committed_steps(self) -> list[int]:
    """Steps Orbax lists that also carry the commit marker, newest first.

    On local disks Orbax trusts the final directory name alone, so a step copied or written
    only in part (a crash on a filesystem without atomic rename) would otherwise count.
    """
    return sorted((s for s in self._mngr.all_steps()
                   if (self.step_dir(s) / COMMIT_MARKER).exists()), reverse=True)

  def uncommitted_steps(self) -> list[int]:
    """Step folders without the commit marker (saves that never finished, or copied in
    part): never restored."""
    return sorted(set(self._mngr.all_steps()) - set(self._committed_steps()))

  def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    saved = self._mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    _check_compatible(saved.config, self.cfg, self._tokenizer, self.step_dir(step),
                      self.key_names)
    _check_structure(self._mngr.item_metadata(step).state, abstract_state,
                     self.step_dir(step))
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out.state, _decode_data_state(out.data)

  def set_aside(self, failures: list[tuple[int, Exception | None]], then: str) -> None:
    """Renames bad steps to `<step>.corrupt` (kept for inspection, invisible to Orbax), each
    with one warning naming it, why (None: no commit marker), and `then`, what the run does
    instead (restores an older step, starts from step 0)."""
    if not failures:
      return
    if jax.process_index() == 0:
      for s, e in failures:
        src = self.step_dir(s)
        dst = src.parent / f"{src.name}.corrupt"
        if dst.exists():
          dst = dst.parent / f"{dst.name}-{time.time_ns()}"
        why = f" ({first_line(e)})" if e is not None else " (no commit marker)"
        try:
          src.rename(dst)
          warnings.warn(f"checkpoint {src} is unusable{why}: moved to {dst}; {then}")
        except OSError as err:
          warnings.warn(f"checkpoint {src} is unusable{why}, and could not be moved aside "
                        f"({err}); {then}")
    self._barriers += 1
    ocp.multihost.sync_global_processes(f"bdlm_jax_checkpoint_set_aside_{self._barriers}")
    self._mngr.reload()


def write_manifest(step_dir: epath.Path) -> None:
  """Records the size and sha256 of every file of a committed step in `MANIFEST`, written to
  a temporary file and renamed: a manifest present is a manifest whole."""
  files = {str(f.relative_to(step_dir)): dict(size=f.stat().length, sha256=sha256(f))
           for f in sorted(_files(step_dir)) if not f.name.startswith(MANIFEST)}
  tmp = step_dir / f"{MANIFEST}.tmp"
  tmp.write_text(json.dumps(dict(files=files), indent=1))
  tmp.replace(step_dir / MANIFEST)


def verify_manifest(step_dir: epath.Path) -> bool:
  """Whether the step has a manifest; raises DamagedCheckpoint naming the first file that is
  missing or differs from it."""
  manifest = step_dir / MANIFEST
  if not manifest.exists():
    return False
  for name, want in json.loads(manifest.read_text())["files"].items():
    f = step_dir / name
    if not f.exists():
      raise DamagedCheckpoint(f"{name} is missing")
    size = f.stat().length
    if size != want["size"]:
      raise DamagedCheckpoint(f"{name} has {size} bytes, {want['size']} when saved")
    if sha256(f) != want["sha256"]:
      raise DamagedCheckpoint(f"{name} differs from what was saved (sha256 {MANIFEST})")
  return True


def _files(folder: epath.Path):
  """Every file under `folder` (epath's rglob refuses `**`, as on GCS it lists everything)."""
  for path in folder.iterdir():
    if path.is_dir():
      yield from _files(path)
    else:
      yield path


class _OrbaxErrors(logging.Filter):
  """Drops the error records (tracebacks, hundreds of lines) Orbax's threads log when a save
  fails, keeping the first message: `Checkpointer.wait` raises the failure as one line."""

  def __init__(self):
    super().__init__()
    self.first = None

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    if self.first is None:
      self.first = record.getMessage()
    return False


def _quiet_late_reads() -> None:
  """After a failed restore or save, the reads or writes still in flight finish in
  TensorStore's threads and call back into the event loop Orbax has closed ("RuntimeError:
  Event loop is closed"), and the sibling reads of a failed restore fail too, reported when
  their coroutines are collected ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put>", each with TensorStore's whole spec): hundreds of lines
  after the one error that matters. Those unraisable exceptions, and only those, are dropped
  once a Checkpointer exists (a process-wide hook, installed once)."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_late_reads", False):
    return

  def hook(unraisable):
    e, where = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    closed_loop = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
    orbax_read = where is not None and f"{os.sep}orbax{os.sep}" in where.co_filename
    if not (closed_loop or orbax_read):
      previous(unraisable)

  hook.drops_late_reads = True
  sys.unraisablehook = hook


def workdir_path(workdir: epath.PathLike) -> epath.Path:
  """A local folder made absolute; a URL (`gs://bucket/run`) kept, not made `./gs:/bucket/run`."""
  path = epath.Path(workdir)
  return path if path.is_absolute() else path.resolve()


def _check_writable(workdir: epath.Path) -> None:
  """Fails before any training if checkpoints could not be written to `workdir`."""
  if workdir.exists() and not workdir.is_dir():
    raise ConfigError(f"checkpoint workdir {workdir} exists and is not a directory")
  probe = workdir / f".write_test_{uuid.uuid4().hex}"  # one per host
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"checkpoint workdir {workdir} is not writable: {e}") from e


def _tokenizer_fingerprint(cfg: Config) -> str | None:
  """What the token ids mean (`Tokenizer.fingerprint`); None where this machine cannot read
  the tokenizer (an export elsewhere), which leaves it unchecked."""
  try:
    from bdlm_jax.data.tokenizers import make_tokenizer  # late: the data package needs grain
    return make_tokenizer(cfg.data).fingerprint
  except (ConfigError, ImportError):
    return None


def _check_compatible(saved: dict, cfg: Config, tokenizer: str | None, where: str,
                      names: dict | None = None) -> None:
  """Raises ConfigError naming each setting the parameters depend on that changed, and with
  them the changes `trajectory_changes` would refuse next, so that one error names them all.
  `names`: what the keys are called in the config the user set (`configure.PRETRAIN_NAMES`)."""
  now = cfg.to_dict()
  keys = [("model", k) for k in now["model"] if k not in RUNTIME_MODEL_KEYS]
  keys += [("objective", "name"), ("objective", "mask_token_id"), ("data", "seq_len"),
           ("drafter", "target")]  # a drafter's checkpoint holds its target's frozen weights
  if not _clean_stream_only(saved, now):  # an ar model has no blocks
    keys.append(("objective", "block_size"))
  default = Config().to_dict()  # a key newer than the checkpoint had its default there
  was = lambda a, b: saved.get(a, {}).get(b, default[a][b])
  diffs = [_change(f"{a}.{b}", was(a, b), now[a][b], names)
           for a, b in keys if was(a, b) != now[a][b]]
  vocabulary = saved.get(TOKENIZER_KEY)  # absent from checkpoints that predate it
  if vocabulary and tokenizer and vocabulary != tokenizer:
    diffs.append(f"data.tokenizer={saved['data']['tokenizer']!r} (vocabulary {vocabulary}), "
                 f"current config has {cfg.data.tokenizer!r} (vocabulary {tokenizer})")
  if diffs:
    also = [c for c in trajectory_changes(saved, cfg, names) if c not in diffs]
    raise ConfigError(
        f"checkpoint in {where} was written with " + "; ".join(diffs) + ". Resume with the "
        "same settings or use a new workdir." +
        (" Also changed (refused unless --allow-changes): " + "; ".join(also) if also else ""))


def trajectory_changes(saved: dict, cfg: Config, names: dict | None = None) -> list[str]:
  """Each setting of `cfg` that differs from `saved` (a checkpoint's config) and changes what
  a resumed run computes: every key but FREE_ON_RESUME's (and, for an ar model, the block
  and noise settings it never reads). train.steps is one, as the learning-rate schedule spans
  it. Keys newer than the checkpoint are not compared. `names` as in `_check_compatible`."""
  was, now = _flat(saved), _flat(cfg.to_dict())
  free = list(FREE_ON_RESUME)
  if _clean_stream_only(saved, cfg.to_dict()):
    free += [f"objective.{k}" for k in cfg.to_dict()["objective"]
             if k not in ("name", "mask_token_id")]
  is_free = lambda key: any(key == k or key.startswith(f"{k}.") for k in free)
  return [_change(key, was[key], now[key], names)
          for key in sorted(was.keys() & now.keys()) if was[key] != now[key] and not is_free(key)]


def _clean_stream_only(saved: dict, now: dict) -> bool:
  """Whether both configs train one objective whose rows are the clean tokens alone (ar):
  it reads no block or noise setting."""
  name = now["objective"]["name"]
  return saved.get("objective", {}).get("name") == name and not get_objective(name).NOISY_STREAM


def _change(key: str, was: Any, now: Any, names: dict | None) -> str:
  """"key=was, current config has now", the key named as the user sets it."""
  return f"{(names or {}).get(key, key)}={was!r}, current config has {now!r}"


def _flat(tree: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def _check_structure(saved_meta: Any, abstract_state: Any, where: str) -> None:
  """Raises ConfigError if the saved state's keys or shapes differ from `abstract_state`."""
  def flat(tree):
    return {".".join(str(k) for k in path): leaf
            for path, leaf in ocp.tree.to_flat_dict(tree).items()}
  saved, wanted = flat(saved_meta), flat(abstract_state)
  problems = []
  if missing := sorted(wanted.keys() - saved.keys()):
    problems.append(f"not in the checkpoint: {missing}")
  if extra := sorted(saved.keys() - wanted.keys()):
    problems.append(f"only in the checkpoint: {extra}")
  for key in sorted(wanted.keys() & saved.keys()):
    was, now = (tuple(getattr(tree[key], "shape", ())) for tree in (saved, wanted))
    if was != now:
      problems.append(f"{key} has shape {was} in the checkpoint, {now} now")
  if problems:
    raise ConfigError(f"checkpoint in {where} does not match the state to restore (did the "
                      f"model or optimizer change?): " + "; ".join(problems))


def _encode_data_state(data_state: Any) -> dict:
  """Grain iterator states are JSON dicts or bytes; JSON can only hold the bytes as text."""
  if isinstance(data_state, (bytes, bytearray)):
    return {"kind": "bytes", "value": base64.b64encode(bytes(data_state)).decode("ascii")}
  return {"kind": "json", "value": data_state}


def _decode_data_state(item: dict) -> Any:
  if item["kind"] == "bytes":
    return base64.b64decode(item["value"])
  return item["value"]
