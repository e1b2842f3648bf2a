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
when complete, so a run killed mid-save leaves no step directory. A step directory that is
present but unusable anyway (no commit marker, truncated or garbage files) is skipped on
restore, with a warning, in favour of the newest step that restores.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError

COMMIT_MARKER = "commit_success.txt"  # Orbax writes it into a step before the final rename.
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # of a step folder Orbax is still writing

# Model keys that change how the model runs, not what its parameters mean: a run may resume
# with a different kernel, remat policy, compute dtype or loss chunk.
RUNTIME_MODEL_KEYS = ("attention_impl", "attention_chunk", "remat", "compute_dtype",
                      "logits_chunk", "row_chunks")

# Settings a run may resume with changed (`trajectory_changes`): how it runs, logs and
# checkpoints, not what it computes (every mesh, strategy and micro-batching gives the same
# loss and gradients), and what only other modes or a fresh run read. A section covers its keys.
FREE_ON_RESUME = ("mode", "init_from", "parallel", "sample", "eval", "export", "plan", "prepare",
                  *(f"model.{k}" for k in RUNTIME_MODEL_KEYS), "data.num_threads",
                  "train.grad_accum", "train.log_every", "train.ckpt_every",
                  "train.max_to_keep", "train.async_checkpoint", "train.peak_tflops",
                  "train.max_bad_steps", "train.eval_every")

# Key of the config item that records `Tokenizer.fingerprint`: what the token ids meant.
TOKENIZER_KEY = "tokenizer_fingerprint"
# Key of the config item that records the prepared folder's records (`prepare.fingerprint`):
# the same data.path re-prepared from another corpus is other data.
DATA_KEY = "data_fingerprint"


class CheckpointError(RuntimeError):
  """No usable checkpoint: every candidate step is missing, truncated or corrupt."""


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
               max_to_keep: int, async_save: bool = True):
    if save_every < 1 or max_to_keep < 1:
      raise ConfigError(
          f"need save_every >= 1 and max_to_keep >= 1, got {save_every} and {max_to_keep}")
    self.workdir = workdir_path(workdir)
    self.cfg = cfg
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

  def save(self, step: int, state: Any, data_state: Any = None, force: bool = False) -> bool:
    """Starts saving `step` if it is due (or `force`); returns whether it did.

    With async_save the arrays are copied off the devices before this returns and written in
    the background; call `wait()` before reading the files or exiting.
    """
    if step in self._mngr.all_steps():
      return False  # already on disk, e.g. the step we just resumed from
    return self._mngr.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(_encode_data_state(data_state)),
        config=ocp.args.JsonSave({**self.cfg.to_dict(), TOKENIZER_KEY: self._tokenizer,
                                  DATA_KEY: self._data_fingerprint()}),
    ))

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
    if self._data is None and self.cfg.data.source == "tokens":
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
    _quiet_late_reads()  # before: a failed read's siblings may call back at once
    candidates = [step] if step is not None else self._committed_steps()
    if not candidates:
      raise FileNotFoundError(f"no committed checkpoint to restore in {self.workdir}")
    failures = []
    for s in candidates:
      try:
        state, data_state = self._restore_step(s, abstract_state)
      except ConfigError:
        raise  # the current config or state does not fit: an older step would not either
      except Exception as e:  # pylint: disable=broad-except
        if step is not None:
          raise CheckpointError(f"cannot restore checkpoint {self.step_dir(s)}: {e}") from e
        if s != candidates[-1]:  # the last one's failure is in the error below
          warnings.warn(f"checkpoint {self.step_dir(s)} is unreadable ({_short(e)}); "
                        f"trying an older one")
        failures.append((s, e))
        continue
      # An older step restored with the same arguments, so the newer ones are truly bad.
      self._set_aside([f for f, _ in failures] + self._uncommitted_steps())
      return s, state, data_state
    raise CheckpointError(
        f"no checkpoint in {self.workdir} restores (if all fail alike, check the abstract "
        f"state and mesh):\n" +
        "\n".join(f"  {self.step_dir(s)}: {_short(e)}" for s, e in failures))

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
    """Blocks until pending async saves are on disk; call before exiting."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()

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

  def _uncommitted_steps(self) -> list[int]:
    return sorted(set(self._mngr.all_steps()) - set(self._committed_steps()))

  def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
    saved = self._mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    _check_compatible(saved.config, self.cfg, self._tokenizer, self.step_dir(step))
    _check_structure(self._mngr.item_metadata(step).state, abstract_state,
                     self.step_dir(step))
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out.state, _decode_data_state(out.data)

  def _set_aside(self, steps: list[int]) -> None:
    """Renames bad steps to `<step>.corrupt` (kept for inspection, invisible to Orbax)."""
    if not steps:
      return
    if jax.process_index() == 0:
      for s in steps:
        src = self.step_dir(s)
        dst = src.parent / f"{src.name}.corrupt"
        if dst.exists():
          dst = dst.parent / f"{dst.name}-{time.time_ns()}"
        try:
          src.rename(dst)
          warnings.warn(f"moved unusable checkpoint {src} to {dst}")
        except OSError as e:
          warnings.warn(f"could not move unusable checkpoint {src} aside: {e}")
    self._barriers += 1
    ocp.multihost.sync_global_processes(f"bdlm_jax_checkpoint_set_aside_{self._barriers}")
    self._mngr.reload()


def _quiet_late_reads() -> None:
  """After a failed restore, the reads still in flight finish in TensorStore's threads and
  call back into the event loop Orbax has closed: dozens of "RuntimeError: Event loop is
  closed" tracebacks (unraisable exceptions) around the one error that matters. Those, and
  only those, are dropped from the first restore on (a process-wide hook, installed once)."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_late_reads", False):
    return

  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
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


def _check_compatible(saved: dict, cfg: Config, tokenizer: str | None, where: str) -> None:
  """Raises ConfigError naming each setting the parameters depend on that changed."""
  now = cfg.to_dict()
  keys = [("model", k) for k in now["model"] if k not in RUNTIME_MODEL_KEYS]
  keys += [("objective", "name"), ("objective", "block_size"), ("objective", "mask_token_id"),
           ("data", "seq_len")]
  missing = "<missing>"
  diffs = [f"{a}.{b}={saved.get(a, {}).get(b, missing)!r}, current config has {now[a][b]!r}"
           for a, b in keys if saved.get(a, {}).get(b, missing) != now[a][b]]
  was = saved.get(TOKENIZER_KEY)  # absent from checkpoints that predate it
  if was and tokenizer and was != tokenizer:
    diffs.append(f"data.tokenizer={saved['data']['tokenizer']!r} (vocabulary {was}), current "
                 f"config has {cfg.data.tokenizer!r} (vocabulary {tokenizer})")
  if diffs:
    raise ConfigError(f"checkpoint in {where} was written with " +
                      "; ".join(diffs) + ". Resume with the same settings or use a new workdir.")


def trajectory_changes(saved: dict, cfg: Config) -> list[str]:
  """Each setting of `cfg` that differs from `saved` (a checkpoint's config) and changes what
  a resumed run computes: every key but FREE_ON_RESUME's. train.steps is one, as the
  learning-rate schedule spans it. Keys newer than the checkpoint are not compared."""
  was, now = _flat(saved), _flat(cfg.to_dict())
  free = lambda key: any(key == k or key.startswith(f"{k}.") for k in FREE_ON_RESUME)
  return [f"{key}={was[key]!r}, current config has {now[key]!r}"
          for key in sorted(was.keys() & now.keys()) if was[key] != now[key] and not free(key)]


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


def _short(e: Exception, limit: int = 300) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= limit else text[:limit] + "..."
