"""Checkpointer: round trips onto the mesh, retention, config checks and crash recovery."""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.checkpoint import CheckpointError, Checkpointer
from bdlm_jax.checkpoint.manager import (MANIFEST, TMP_SUFFIX, DamagedCheckpoint,
                                         trajectory_changes, verify_manifest, workdir_path)
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from tests.data.conftest import hf_tokenizer_path  # noqa: F401  (a fixture)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(seed: int = 0):
  """A small train state: sharded params, adamw state, int step, raw rng key data."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {
      "w_DxF": jax.device_put(jnp.arange(32.0).reshape(8, 4) + seed,
                              NamedSharding(mesh, P("x", None))),
      "b_F": jnp.full((4,), float(seed)),
  }
  tx = optax.adamw(1e-2)
  opt_state = tx.init(params)
  _, opt_state = tx.update(params, opt_state, params)  # non-zero moments, count 1
  return {"params": params, "opt_state": opt_state, "step": jnp.int32(seed),
          "rng": jax.random.key_data(jax.random.key(seed))}


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.sharding == y.sharding
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def checkpointer(tmp_path, cfg=None, **kw):
  kw = {"save_every": 1, "max_to_keep": 5, **kw}
  return Checkpointer(str(tmp_path / "ckpt"), cfg or Config(), **kw)


def save_steps(tmp_path, steps, **kw):
  with checkpointer(tmp_path, **kw) as ckpt:
    for s in steps:
      assert ckpt.save(s, make_state(s), data_state={"epoch": 0, "index": s})
    ckpt.wait()


def test_round_trip_restores_state_onto_the_mesh_sharding(tmp_path):
  state = make_state(3)
  with checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(3, state, data_state={"epoch": 1, "index": 42})
    ckpt.wait()
  with checkpointer(tmp_path) as ckpt:  # a fresh process resumes
    assert ckpt.latest_step() == 3
    step, restored, data_state = ckpt.restore(abstract(state))
  assert step == 3 and data_state == {"epoch": 1, "index": 42}
  assert_same(restored, state)
  assert restored["params"]["w_DxF"].sharding.spec == P("x", None)
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)


@pytest.mark.parametrize("data_state", [b"\x00grain\xffstate", None, [1, "two"]])
def test_data_iterator_state_round_trips(tmp_path, data_state):
  state = make_state()
  with checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(0, state, data_state=data_state)
    assert ckpt.restore(abstract(state))[2] == data_state


def test_saves_every_save_every_steps_unless_forced(tmp_path):
  state = make_state()
  with checkpointer(tmp_path, save_every=10) as ckpt:
    saved = [s for s in range(1, 25) if ckpt.save(s, state)]
    assert ckpt.save(25, state, force=True)
    assert not ckpt.save(25, state, force=True)  # already on disk: not an error
    ckpt.wait()
  assert saved == [10, 20]


def test_keeps_only_the_newest_max_to_keep_steps(tmp_path):
  save_steps(tmp_path, range(1, 6), max_to_keep=2)
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "5"]
  with checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 5


def test_restore_names_the_changed_model_setting(tmp_path):
  save_steps(tmp_path, [1])
  changed = replace(Config(), model=dict(d_model=256), data=dict(seq_len=256))
  with checkpointer(tmp_path, cfg=changed) as ckpt:
    with pytest.raises(ConfigError) as err:
      ckpt.restore(abstract(make_state()))
  msg = str(err.value)
  assert str(tmp_path / "ckpt" / "1") in msg
  assert "model.d_model=128, current config has 256" in msg
  assert "data.seq_len=128, current config has 256" in msg


def test_restore_names_a_changed_mask_id_tokenizer_and_vocabulary(tmp_path, hf_tokenizer_path):
  save_steps(tmp_path, [1], cfg=replace(Config(), data=dict(tokenizer=hf_tokenizer_path)))
  changed = replace(Config(), model=dict(vocab_size=300), objective=dict(mask_token_id=299))
  with checkpointer(tmp_path, cfg=changed) as ckpt:
    with pytest.raises(ConfigError) as err:
      ckpt.restore(abstract(make_state()))
  msg = str(err.value)
  assert "objective.mask_token_id=259, current config has 299" in msg
  assert "model.vocab_size=260, current config has 300" in msg
  assert f"data.tokenizer={hf_tokenizer_path!r} (vocabulary sha256:" in msg
  assert "current config has 'byte' (vocabulary byte)" in msg


def test_restore_accepts_the_same_tokenizer_moved(tmp_path, hf_tokenizer_path):
  save_steps(tmp_path, [1], cfg=replace(Config(), data=dict(tokenizer=hf_tokenizer_path)))
  moved = tmp_path / "elsewhere" / "tokenizer.json"
  moved.parent.mkdir()
  moved.write_text(open(hf_tokenizer_path).read())
  cfg = replace(Config(), data=dict(tokenizer=str(moved.parent)))
  with checkpointer(tmp_path, cfg=cfg) as ckpt:
    assert ckpt.restore(abstract(make_state()))[0] == 1


def test_restore_allows_a_different_attention_kernel(tmp_path):
  save_steps(tmp_path, [1])
  runtime_only = replace(Config(), model=dict(attention_impl="pallas", remat="full"))
  with checkpointer(tmp_path, cfg=runtime_only) as ckpt:
    assert ckpt.restore(abstract(make_state()))[0] == 1


def test_restore_rejects_a_state_of_another_shape(tmp_path):
  save_steps(tmp_path, [1])
  wanted = abstract(make_state())
  wanted["params"]["b_F"] = jax.ShapeDtypeStruct((5,), jnp.float32,
                                                 sharding=wanted["params"]["b_F"].sharding)
  wanted["params"]["extra"] = wanted["params"]["b_F"]
  with checkpointer(tmp_path) as ckpt:
    with pytest.raises(ConfigError, match=r"params\.b_F has shape \(4,\).*\(5,\) now") as err:
      ckpt.restore(wanted)
  assert "not in the checkpoint: ['params.extra']" in str(err.value)


def test_unwritable_workdir_fails_at_construction(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  for workdir in [a_file, a_file / "ckpt"]:
    with pytest.raises((ConfigError, OSError), match=str(workdir)):
      Checkpointer(str(workdir), Config(), save_every=1, max_to_keep=1)


def test_read_only_parent_fails_at_construction(shared_tmp, permissions_enforced):
  read_only = shared_tmp / "ro"
  with permissions_enforced():
    read_only.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="not writable"):
      Checkpointer(str(read_only / "ckpt"), Config(), save_every=1, max_to_keep=1)
  assert not (read_only / "ckpt").exists()


def test_a_url_workdir_stays_a_url(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(workdir_path("gs://bucket/run")) == "gs://bucket/run"
  assert str(workdir_path("runs/x")) == str(tmp_path / "runs" / "x")


def test_a_run_killed_mid_save_resumes_from_the_previous_step(tmp_path):
  """A real process dies between writing step 2's files and committing them."""
  script = textwrap.dedent(f"""
      import os
      os.environ["JAX_PLATFORMS"] = "cpu"
      import jax
      jax.config.update("jax_num_cpu_devices", 8)
      from orbax.checkpoint._src.path import atomicity
      from bdlm_jax.checkpoint import Checkpointer
      from bdlm_jax.config import Config
      from tests.checkpoint.test_manager import make_state
      ckpt = Checkpointer({str(tmp_path / "ckpt")!r}, Config(), save_every=1, max_to_keep=5)
      ckpt.save(1, make_state(1), {{"index": 1}})
      ckpt.wait()
      async def die(self, *args, **kwargs):
        os._exit(17)  # killed: no cleanup, no exception handlers
      atomicity.AtomicRenameTemporaryPath.finalize = die
      ckpt.save(2, make_state(2), {{"index": 2}})
      ckpt.wait()
  """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 17, proc.stderr[-2000:]
  leftovers = os.listdir(tmp_path / "ckpt")
  assert "2.orbax-checkpoint-tmp" in leftovers and "2" not in leftovers
  with checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    step, state, data_state = ckpt.restore(abstract(make_state()))
    assert (step, data_state) == (1, {"index": 1})
    assert_same(state, make_state(1))
    assert ckpt.save(2, make_state(2))  # the interrupted step can be written again
    ckpt.wait()
    assert ckpt.latest_step() == 2
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]  # the leftover was replaced


def test_unfinished_saves_are_removed_and_committed_steps_kept(tmp_path):
  """An emergency save on preemption, killed mid-write, at a step no later save repeats."""
  save_steps(tmp_path, [1])
  (tmp_path / "ckpt" / f"7{TMP_SUFFIX}" / "state").mkdir(parents=True)
  with checkpointer(tmp_path) as ckpt:
    ckpt.remove_unfinished_saves()
    assert ckpt.latest_step() == 1
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]


def truncate_files(root):
  for dirpath, _, names in os.walk(root):
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def garble_files(root):
  for dirpath, _, names in os.walk(root):
    for name in names:
      with open(os.path.join(dirpath, name), "wb") as f:
        f.write(b"\x13garbage" * 3)


# A failed tensorstore read can leave other reads to finish after Orbax closed its event loop
# ("Event loop is closed", printed by Python as an unraisable exception): noise, not a failure.
IGNORE_LATE_READS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


@IGNORE_LATE_READS
@pytest.mark.parametrize("damage", [
    "no_commit_marker",  # e.g. a partial copy; Orbax alone would list it on a local disk
    "truncated_arrays",  # the merged OCDBT data files that restore reads
    "truncated_state",   # every file of the state item, JSON metadata included
    "garbage_state",
])
def test_a_damaged_newest_step_falls_back_to_the_previous_one(tmp_path, damage):
  save_steps(tmp_path, [1, 2])
  step2 = tmp_path / "ckpt" / "2"
  if damage == "no_commit_marker":
    os.remove(step2 / "commit_success.txt")
  elif damage == "truncated_arrays":
    truncate_files(step2 / "state" / "d")
  elif damage == "truncated_state":
    truncate_files(step2 / "state")
  else:
    garble_files(step2 / "state")
  with checkpointer(tmp_path) as ckpt:
    # Only restore reads the files; a step without its commit marker is never listed.
    assert ckpt.latest_step() == (1 if damage == "no_commit_marker" else 2)
    with pytest.warns(UserWarning, match=str(step2)):
      step, state, data_state = ckpt.restore(abstract(make_state()))
    assert (step, data_state) == (1, {"epoch": 0, "index": 1})
    assert_same(state, make_state(1))
    assert os.path.isdir(f"{step2}.corrupt")  # kept for inspection, out of the way
    assert ckpt.save(2, make_state(2))
    ckpt.wait()
    assert ckpt.restore(abstract(make_state()))[0] == 2


@IGNORE_LATE_READS
def test_a_corrupt_only_checkpoint_raises_naming_its_path(tmp_path):
  save_steps(tmp_path, [1])
  garble_files(tmp_path / "ckpt" / "1" / "state")
  with checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "1")):
      ckpt.restore(abstract(make_state()))
    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "1")):
      ckpt.restore(abstract(make_state()), step=1)
  assert os.path.isdir(tmp_path / "ckpt" / "1")  # nothing is moved when nothing restores


def test_a_truncated_only_checkpoint_is_refused_in_one_error_without_tracebacks(tmp_path):
  """A real process restores a checkpoint whose array files are cut in half, and no older
  one: its stderr is the error alone (before, a "trying an older one" warning and dozens of
  "RuntimeError: Event loop is closed" tracebacks of TensorStore reads still in flight)."""
  save_steps(tmp_path, [1])
  truncate_files(tmp_path / "ckpt" / "1" / "state" / "d")
  script = textwrap.dedent(f"""
      import os, sys, time
      os.environ["JAX_PLATFORMS"] = "cpu"
      import jax
      jax.config.update("jax_num_cpu_devices", 8)
      from bdlm_jax.checkpoint import CheckpointError, Checkpointer
      from bdlm_jax.config import Config
      from tests.checkpoint.test_manager import abstract, make_state
      with Checkpointer({str(tmp_path / "ckpt")!r}, Config(), save_every=1,
                        max_to_keep=5) as ckpt:
        try:
          ckpt.restore(abstract(make_state()))
        except CheckpointError as e:
          print(f"error: {{e}}", file=sys.stderr)
      time.sleep(1)  # the reads in flight finish
  """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  err = proc.stderr
  assert f"error: no checkpoint in {tmp_path / 'ckpt'} restores" in err, err[-2000:]
  assert "Traceback" not in err and "trying an older one" not in err, err[-2000:]


def test_a_resumed_run_may_change_how_it_runs_but_not_what_it_computes():
  now = Config()
  how = replace(now, parallel=dict(strategy="cp_ring", seq=4), model=dict(remat="full"),
                train=dict(grad_accum=2, log_every=1, ckpt_every=7), data=dict(num_threads=0))
  assert trajectory_changes(how.to_dict(), now) == []
  what = replace(now, train=dict(steps=50, lr=0.01), data=dict(shuffle=False), seed=3)
  assert trajectory_changes(what.to_dict(), now) == [
      "data.shuffle=False, current config has True", "seed=3, current config has 0",
      "train.lr=0.01, current config has 0.003", "train.steps=50, current config has 200"]


def flip_bytes_in_largest_array_file(step_dir):
  """XOR 0xFF over 4 KiB at a third of the largest OCDBT data file: same size, other bytes."""
  d = step_dir / "state" / "ocdbt.process_0" / "d"
  path = max(d.iterdir(), key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 3)
    block = f.read(4096)
    f.seek(-len(block), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in block))


def test_a_step_damaged_at_the_same_size_is_set_aside_naming_both_steps(tmp_path):
  """Before: the flipped bytes restored as valid arrays, without a word. Now every committed
  step records its files' sizes and sha256, compared before anything is read."""
  save_steps(tmp_path, [1, 2])
  step2 = tmp_path / "ckpt" / "2"
  assert os.path.isfile(step2 / MANIFEST)
  flip_bytes_in_largest_array_file(step2)
  with checkpointer(tmp_path) as ckpt:
    with pytest.warns(UserWarning) as warned:
      step, state, _ = ckpt.restore(abstract(make_state()))
  assert step == 1
  assert_same(state, make_state(1))
  [line] = [str(w.message) for w in warned]
  assert line.startswith(f"checkpoint {step2} is unusable (DamagedCheckpoint: state/"), line
  assert f"moved to {step2}.corrupt; restored {tmp_path / 'ckpt' / '1'} instead" in line, line


def test_each_file_of_a_step_damaged_at_the_same_size_is_named(tmp_path):
  """Every file the step holds is in its manifest and checked: the metadata, the OCDBT
  manifests and data files, the first and the last entries alike. One byte flipped in any of
  them raises DamagedCheckpoint naming that file; restored, the step verifies again."""
  save_steps(tmp_path, [1])
  step1 = tmp_path / "ckpt" / "1"
  listed = json.loads((step1 / MANIFEST).read_text())["files"]
  on_disk = {str(f.relative_to(step1)) for f in step1.rglob("*") if f.is_file()}
  assert set(listed) == on_disk - {MANIFEST}
  assert {"_CHECKPOINT_METADATA", "state/_METADATA",
          "state/ocdbt.process_0/manifest.ocdbt"} <= set(listed)
  for name in listed:
    path = step1 / name
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DamagedCheckpoint, match=f"^{name} differs from what was saved"):
      verify_manifest(epath.Path(step1))
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      f.write(byte)
  assert verify_manifest(epath.Path(step1))


def test_a_step_without_a_manifest_restores_unverified_with_a_warning(tmp_path):
  """Checkpoints written before manifests existed still restore."""
  save_steps(tmp_path, [1])
  os.remove(tmp_path / "ckpt" / "1" / MANIFEST)
  with checkpointer(tmp_path) as ckpt:
    with pytest.warns(UserWarning, match=f"{tmp_path / 'ckpt' / '1'} has no {MANIFEST}.*"
                                         "restored unverified"):
      assert ckpt.restore(abstract(make_state()))[0] == 1


def test_the_sibling_reads_of_a_failed_restore_are_not_reported_but_other_errors_are(
    tmp_path, monkeypatch):
  """A restore that failed on a damaged file was followed by up to ~390 lines of "Exception
  ignored in: <coroutine object _read_array_index_and_device_put>" (its other reads, failing
  as they are collected): dropped. Any other unraisable exception is still reported."""
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.object))
  checkpointer(tmp_path).close()  # installs the hook
  namespace = {}  # a coroutine function defined in a file of Orbax's, as its reads are
  exec(compile("async def read():\n  pass\n",
               os.path.join(os.sep, "site-packages", "orbax", "serialization.py"), "exec"),
       namespace)
  read = namespace["read"]()
  try:
    for culprit in (read, "something else"):
      sys.unraisablehook(SimpleNamespace(
          exc_type=Exception, exc_value=Exception("Encountered error while reading"),
          exc_traceback=None, err_msg=None, object=culprit))
  finally:
    read.close()
  assert reported == ["something else"]


def test_what_the_parameters_depend_on_is_named_at_once_and_ar_has_no_blocks():
  """Issue items 6 and 7: a drafter's target is part of its checkpoint (before, mode=eval
  silently used the saved one); an ar model reads no block size, so changing it is free
  (before, refused even with --allow-changes); every changed key is named in one error."""
  from bdlm_jax.checkpoint.manager import _check_compatible
  from bdlm_jax.configure import PRETRAIN_NAMES, load_config
  config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
  saved = load_config(config, ["objective.name=ar"])
  now = load_config(config, ["objective.name=ar", "objective.block_size=8"])
  _check_compatible(saved.to_dict(), now, None, "w")
  assert trajectory_changes(saved.to_dict(), now) == []
  now = load_config(config, ["objective.name=ar", "model.d_model=64", "train.lr=0.1"])
  with pytest.raises(ConfigError, match=r"model.d_model=128, current config has 64\. Resume .* "
                                        r"Also changed .*: pretrain.lr=0.001, current config "
                                        r"has 0.1"):
    _check_compatible(saved.to_dict(), now, None, "w", PRETRAIN_NAMES)
  drafter = saved.to_dict()
  drafter["drafter"]["target"] = "runs/other_target"
  with pytest.raises(ConfigError, match="drafter.target='runs/other_target', current config has "
                                        "''"):
    _check_compatible(drafter, saved, None, "w")


def test_a_checkpoint_older_than_a_model_key_restores_where_the_key_is_its_default(tmp_path):
  """A key added after a checkpoint was written (model.rope_scaling, model.qkv_bias) had its
  default there: a config at that default restores it; another value is refused, naming the
  default as what the checkpoint holds. (Before: every such checkpoint was refused, its key
  '<missing>'.)"""
  from bdlm_jax.checkpoint.manager import _check_compatible
  cfg = Config()
  saved = cfg.to_dict()
  del saved["model"]["qkv_bias"]
  _check_compatible(saved, cfg, None, "w")
  with pytest.raises(ConfigError, match="model.qkv_bias=False, current config has True"):
    _check_compatible(saved, replace(cfg, model=dict(qkv_bias=True)), None, "w")
