"""run.py: overrides, what lands in --workdir, --resume, and one clear error per bad input."""

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import run
from bdlm_jax import feed
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.configure import load_config
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.train import abstract_state
from tests.test_train import StopAfter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart_bd3lm.py")
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=64", "data.seq_len=32", "objective.block_size=8",
        "train.batch_size=4", "train.warmup_steps=1", "train.log_every=2", "train.ckpt_every=2",
        "train.eval_every=0"]  # tests/test_evaluate.py runs the eval
STEPS = 4


def argv(*overrides, workdir=None, flags=()):
  args = ["--config", QUICKSTART, "--no-progress", *flags]
  if workdir is not None:
    args += ["--workdir", str(workdir)]
  for item in [*TINY, *overrides]:
    args += ["--set", item]
  return args


def step_1_loss(config, workdir, sets) -> float:
  """The logged loss of a run of `config` with `sets` (its first metrics row)."""
  args = ["--config", config, "--no-progress", "--workdir", str(workdir)]
  for item in sets:
    args += ["--set", item]
  assert run.main(args) == 0
  return rows(workdir)[0]["loss"]


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def snapshot(workdir):
  """{relative path: sha256} of every file under `workdir`."""
  out = {}
  for root, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
  return out


def checkpoint_steps(workdir):
  return sorted(int(d) for d in os.listdir(workdir) if d.isdigit())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir after `STEPS` steps with train.peak_tflops set (so MFU is computed)."""
  workdir = tmp_path_factory.mktemp("cli") / "run"
  assert run.main(argv(f"train.steps={STEPS}", "train.peak_tflops=1", workdir=workdir)) == 0
  return str(workdir)


def test_run_writes_metrics_tensorboard_and_checkpoints(trained):
  assert [row["step"] for row in rows(trained)] == [2, 4]
  for row in rows(trained):
    for key in ("loss", "tokens_per_s", "step_time_s", "lr", "grad_norm"):
      assert isinstance(row[key], float), (key, row)
    assert isinstance(row["mfu"], float) and 0 < row["mfu"]
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(f"{trained}/tb"))
  assert checkpoint_steps(trained) == [2, 4]
  with open(os.path.join(trained, "4", "config", "metadata")) as f:
    assert json.load(f)["model"]["d_model"] == 32  # --set reached the saved config


def test_resume_continues_from_the_last_checkpoint(trained, tmp_path):
  """A run that died after logging step 4 but before checkpointing it (and in the middle of
  an emergency save of step 3) redoes step 4 alike, logs it once and drops the unfinished
  save."""
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  shutil.rmtree(os.path.join(workdir, str(STEPS)))
  os.makedirs(os.path.join(workdir, "3.orbax-checkpoint-tmp", "state"))
  before = rows(workdir)
  assert run.main(argv(f"train.steps={STEPS}", "train.peak_tflops=1", workdir=workdir,
                       flags=["--resume"])) == 0
  after = rows(workdir)
  assert after[0] == before[0] and [row["step"] for row in after] == [2, 4]
  assert after[1]["loss"] == pytest.approx(before[1]["loss"], rel=1e-6)
  assert checkpoint_steps(workdir) == [2, 4]
  assert not os.path.exists(os.path.join(workdir, "3.orbax-checkpoint-tmp"))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
@pytest.mark.filterwarnings("ignore:train.lr=.* cannot train")
def test_non_finite_steps_are_skipped_and_stop_the_run_keeping_the_good_checkpoints(
    trained, tmp_path, capsys):
  """From step 5 on, train.lr=1e39 (inf in float32) makes every update non-finite. No step is
  applied or saved (ckpt_every=1 would save 5-7, and max_to_keep=2 then delete both good
  checkpoints), each is counted, and the third in a row stops the run naming it and the last
  good checkpoint."""
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  code = run.main(argv("train.steps=10", "train.lr=1e39", "train.ckpt_every=1",
                       "train.max_to_keep=2", "train.max_bad_steps=3", workdir=workdir,
                       flags=["--resume", "--allow-changes"]))
  line = error_line(capsys)
  assert code == 2
  assert "steps 5-7 had a non-finite loss, gradient or update" in line, line
  assert f"stopped at step 7. Last good checkpoint: {workdir}/4 (step 4;" in line, line
  assert checkpoint_steps(workdir) == [2, 4]
  assert [(row["step"], row["skipped_steps"]) for row in rows(workdir)] == [(2, 0), (4, 0), (6, 2)]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
@pytest.mark.filterwarnings("ignore:train.lr=.* cannot train")
def test_a_skipped_last_step_still_writes_the_final_checkpoint(trained, tmp_path):
  """Steps 5 and 6 are skipped (fewer than max_bad_steps in a row): step 5 gets no save of
  its own, but the run's final checkpoint (the last good state) is written at step 6."""
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  assert run.main(argv("train.steps=6", "train.lr=1e39", "train.ckpt_every=1",
                       "train.max_bad_steps=3", workdir=workdir,
                       flags=["--resume", "--allow-changes"])) == 0
  assert checkpoint_steps(workdir)[-2:] == [4, 6]


def test_a_learning_rate_that_cannot_train_is_warned_and_no_ruined_state_is_saved(tmp_path,
                                                                                 capsys):
  """The issue's run: lr=1e30 without warmup, ckpt_every=1. Step 1's loss is finite but its
  update ~1e31 x the weights: before, it was applied, saved and named the last good
  checkpoint (weights ~1e30). Now the config warns, no such step is applied or saved, and the
  error says there is no good checkpoint."""
  workdir = tmp_path / "run"
  with pytest.warns(UserWarning, match=r"train.lr=1e\+30 cannot train"):
    code = run.main(argv("train.steps=40", "train.lr=1e30", "train.warmup_steps=0",
                         "train.ckpt_every=1", "train.max_bad_steps=3", workdir=workdir))
  assert code == 2
  line = error_line(capsys)
  assert line.endswith("stopped at step 3. Last good checkpoint: none yet"), line
  assert checkpoint_steps(workdir) == []


def test_resume_of_a_finished_run_says_there_is_nothing_to_train(trained, capsys):
  before = snapshot(trained)
  assert run.main(argv(f"train.steps={STEPS}", workdir=trained, flags=["--resume"])) == 0
  assert f"nothing to train: {trained} is already at train.steps={STEPS}" in capsys.readouterr().out
  after = snapshot(trained)
  assert {path: after.get(path) for path in before} == before


def test_reusing_a_workdir_without_resume_is_refused_and_keeps_it(trained, capsys):
  before = snapshot(trained)
  assert run.main(argv(f"train.steps={STEPS}", workdir=trained)) == 2
  assert "already holds checkpoints (latest step 4); pass --resume" in error_line(capsys)
  assert snapshot(trained) == before


def test_resume_of_a_workdir_without_checkpoints_is_refused_naming_it(tmp_path, capsys):
  """A mistyped --workdir must not train from step 0; --resume-if-present may (preemptible
  jobs rerun one command), and the rerun then resumes."""
  typo = tmp_path / "typo"
  for _ in ("missing", "empty"):
    assert run.main(argv("train.steps=2", workdir=typo, flags=["--resume"])) == 2
    assert f"--resume: {typo} holds no checkpoint to continue from" in error_line(capsys)
    assert not typo.exists() or not os.listdir(typo)
    typo.mkdir(exist_ok=True)
  for _ in range(2):
    assert run.main(argv("train.steps=2", workdir=typo, flags=["--resume-if-present"])) == 0
  assert checkpoint_steps(typo) == [2]
  assert "nothing to train" in capsys.readouterr().out  # the second run resumed


@pytest.mark.parametrize("change,was", [("train.steps=6", 4), ("train.batch_size=8", 4),
                                        ("train.lr=0.01", 0.003)])
def test_resume_refuses_settings_that_change_the_run(trained, capsys, change, was):
  """A longer train.steps would stretch the learning-rate schedule mid-run; another batch or
  learning rate changes the steps. Refused, naming the setting and the way to insist."""
  before = snapshot(trained)
  assert run.main(argv(f"train.steps={STEPS}", change, workdir=trained, flags=["--resume"])) == 2
  line = error_line(capsys)
  key, now = change.split("=")
  assert f"{key}={was}, current config has {now}" in line, line
  assert "pass --allow-changes" in line
  assert snapshot(trained) == before


def test_resume_with_allow_changes_trains_on_and_warns_naming_them(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  with pytest.warns(UserWarning, match=r"with changed settings: train.steps=4, current config "
                                       r"has 6$"):
    assert run.main(argv("train.steps=6", "train.log_every=1", workdir=workdir,
                         flags=["--resume", "--allow-changes"])) == 0
  assert [row["step"] for row in rows(workdir)] == [2, 4, 5, 6]


@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
@pytest.mark.filterwarnings("ignore:checkpoint .* has no checksums.json")
def test_a_damaged_state_without_checksums_is_refused_not_trained_on(trained, tmp_path, capsys):
  """Step 4 holds NaN weights and no manifest to tell (an older checkpoint damaged on disk):
  before, it restored, every step after it was skipped (param_norm NaN), and the run exited
  0, saving a copy of it as step 6. Now its non-finite state stops the run, naming it."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  cfg = load_config(QUICKSTART, TINY + [f"train.steps={STEPS}", "train.peak_tflops=1"])
  with Checkpointer(str(workdir), cfg, save_every=1, max_to_keep=5, async_save=False) as ckpt:
    step, state, data_state = ckpt.restore(abstract_state(cfg, make_mesh(cfg)))
  shutil.rmtree(workdir / str(step))
  with Checkpointer(str(workdir), cfg, save_every=1, max_to_keep=5, async_save=False) as ckpt:
    ckpt.save(step, state._replace(params=jax.tree.map(lambda w: w * np.nan, state.params)),
              data_state, force=True)
    ckpt.wait()
  os.remove(workdir / str(step) / "checksums.json")
  code = run.main(argv("train.steps=6", workdir=workdir, flags=["--resume", "--allow-changes"]))
  line = error_line(capsys)
  assert code == 2
  assert f"error: checkpoint {workdir}/4 holds weights or optimiser moments that are not " \
         "finite" in line, line
  assert checkpoint_steps(workdir) == [2, 4]


@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
def test_a_failed_save_stops_the_run_in_one_line_and_resume_continues(trained, tmp_path,
                                                                     capsys):
  """Files over 64 KiB cannot be written (a full disk's stand-in): step 6's background save
  fails. Before: training went on, ~450 lines of Orbax tracebacks, no error line, exit 1. Now
  the next step boundary stops the run with one line; step 4 stays the latest checkpoint."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  args = argv("train.steps=8", "train.async_checkpoint=true", workdir=workdir,
              flags=["--resume", "--allow-changes"])
  limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
  try:
    code = run.main(args)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
  line = error_line(capsys)
  assert code == 2
  assert line == (f"error: saving checkpoint step 6 to {workdir}/6 failed: File too large; "
                  f"stopped; the last committed checkpoint is {workdir}/4 (continue with "
                  f"--resume)"), line
  assert checkpoint_steps(workdir) == [2, 4]
  assert run.main(args) == 0
  assert checkpoint_steps(workdir)[-2:] == [6, 8]  # resumed from step 4


def error_line(capsys) -> str:
  """The one error line run.py printed; fails on tracebacks or several errors."""
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.startswith(("error:", "config error:"))]
  assert len(lines) == 1, err
  return lines[0]


class SignalAfter(StopAfter):
  """A data iterator that sends this process the real signal `error` once it has given `n`
  batches."""

  def __next__(self):
    if not self._left:
      os.kill(os.getpid(), self._error)
    self._left -= 1
    return next(self._data)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_step_reached_and_resume_continues_from_it(tmp_path, capsys,
                                                                     monkeypatch, signum):
  """A real SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) while the 4th batch is
  read, long before the first checkpoint is due: step 4 runs, is saved, the message names it
  (before: "checkpoints are kept" of a workdir that had none), and --resume continues there."""
  make_dataset = feed.make_dataset
  monkeypatch.setattr(feed, "make_dataset",
                      lambda *a, **kw: SignalAfter(make_dataset(*a, **kw), 3, signum))
  workdir = tmp_path / "run"
  args = argv("train.steps=8", "train.ckpt_every=1000", "train.async_checkpoint=true",
              workdir=workdir)
  assert run.main(args) == 128 + signum
  name = signal.Signals(signum).name
  assert (f"interrupted: {name} at step 4; latest checkpoint {workdir}/4 (step 4): continue "
          f"with --resume") in capsys.readouterr().err
  assert checkpoint_steps(workdir) == [4]
  if signum == signal.SIGINT:
    return  # the same save: resume once
  monkeypatch.undo()
  assert run.main(args + ["--resume"]) == 0
  assert [row["step"] for row in rows(workdir)] == [2, 4, 6, 8]
  assert checkpoint_steps(workdir) == [4, 8]


# Each case runs with --resume on the trained workdir: the error must come before anything
# in it changes. train.steps=6 so that the resumed run would train.
BAD_INPUTS = {
    "unknown key": (["model.dmodel=32"], ["unknown config key 'model.dmodel'", "model.d_model"]),
    "wrong type": (["train.steps=abc"], ["'train.steps' expects int, got 'abc'"]),
    "seq_len vs block": (["data.seq_len=36"], ["data.seq_len=36 is not a multiple of "
                                               "objective.block_size=8"]),
    "missing data file": (["data.source=text", "data.path=/nonexistent/corpus.txt"],
                          ["data.path='/nonexistent/corpus.txt' matches no file"]),
    "tokenizer beyond vocab": (["model.vocab_size=200", "objective.mask_token_id=199"],
                               ["vocab size 260 but model.vocab_size=200"]),
    "mask id is a data token": (["objective.mask_token_id=257"],
                                ["objective.mask_token_id=257 is the EOS token of data.tokenizer"
                                 "='byte'", "use objective.mask_token_id=259"]),
    "mask id changed": (["model.vocab_size=261", "objective.mask_token_id=260"],
                        ["objective.mask_token_id=259, current config has 260",
                         "model.vocab_size=260, current config has 261"]),
    "incompatible checkpoint": (["model.d_model=64"],
                                ["model.d_model=32, current config has 64"]),
    "unknown strategy": (["parallel.strategy=zigzag"],
                         ["parallel.strategy='zigzag' is not one of"]),
    "mesh beyond devices": (["parallel.data=16", "train.batch_size=16"],
                            ["needs 16 devices, but only 8 are visible"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_error_and_loses_nothing(trained, capsys, case):
  overrides, expected = BAD_INPUTS[case]
  before = snapshot(trained)
  code = run.main(argv("train.steps=6", *overrides, workdir=trained, flags=["--resume"]))
  line = error_line(capsys)
  assert code == 2
  for text in expected:
    assert text in line, line
  after = snapshot(trained)
  assert {path: after.get(path) for path in before} == before  # new files (tb events) are fine


def test_an_unwritable_workdir_is_named(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("keep me")
  assert run.main(argv(workdir=blocker / "run")) == 2
  assert f"checkpoint workdir {blocker / 'run'} is not writable" in error_line(capsys)
  assert blocker.read_text() == "keep me"


@pytest.mark.slow
def test_command_line_trains_data_parallel_with_accumulation(tmp_path):
  """End to end in a fresh process: run.py simulates the 2 CPU devices the mesh needs."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  cmd = [sys.executable, os.path.join(REPO, "run.py"),
         *argv("train.steps=2", "parallel.data=2", "train.grad_accum=2", workdir=tmp_path / "run")]
  out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "trained 2 steps: loss" in out.stdout and str(tmp_path / "run") in out.stdout
  assert [row["step"] for row in rows(tmp_path / "run")] == [2]
  assert checkpoint_steps(tmp_path / "run") == [2]


@pytest.mark.slow
def test_plan_mode_compiles_every_strategy_and_names_the_one_to_use(capsys):
  """ar: the strategies that split corrupted blocks say why they cannot run (no compile)."""
  code = run.main(argv("mode=plan", "objective.name=ar", "parallel.strategy=cp_ring",
                       "parallel.seq=2", "plan.device_memory_gb=80"))
  out = capsys.readouterr().out
  assert code == 0
  for strategy in ("cp_allgather", "cp_ring", "bp", "csbp_allgather", "csbp_ring"):
    assert f"| {strategy} |" in out
  assert "| none |" not in out and "fits 80 GB" in out
  assert "cannot run the 'ar' objective" in out
  chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
  assert chosen.startswith(("chosen: cp_allgather", "chosen: cp_ring"))


@pytest.mark.parametrize("overrides, expected", [
    (["plan.device_memory_gb=-1"], "plan.device_memory_gb must be >= 0"),
    (["parallel.strategy=cp_ring", "parallel.seq=16"], "needs 16 devices, but only 8"),
    (["plan.target=tpu"], "plan.target must be cpu, gpu or tpu:<topology>"),
    (["plan.target=gpu"], "plan.target=gpu needs a visible GPU"),
])
def test_plan_mode_config_errors_print_one_line_and_no_traceback(capsys, overrides, expected):
  assert run.main(argv("mode=plan", *overrides)) == 2
  assert expected in error_line(capsys)


@pytest.mark.parametrize("body, expected", [
    ("def get_config():\n  return {'model': 5}\n", "config section 'model' must be a dict"),
    ("def get_config():\n  return {'train': {'lr': 1 / 0}}\n",
     "line 2 raised ZeroDivisionError: division by zero"),
    ("def get_config():\n  return {'train': {'lr': -1.0}}\n", "train.lr must be > 0, got -1.0"),
])
def test_a_broken_config_file_is_one_line_without_traceback(tmp_path, capsys, body, expected):
  config = tmp_path / "broken.py"
  config.write_text(body)
  assert run.main(["--config", str(config), "--workdir", str(tmp_path / "run")]) == 2
  assert expected in error_line(capsys)
  assert not (tmp_path / "run").exists()


def test_resume_refuses_other_data_naming_its_source_and_path(trained, tmp_path, capsys):
  """Another data.source or data.path reads other documents: refused, naming both. (A folder
  prepared from the very corpus, data.source=tokens, reads the same batches, but nothing at
  resume proves it is that corpus's: refused too; --allow-changes insists.)"""
  corpus = tmp_path / "sums.txt"
  corpus.write_text("".join(f"{i}+{i}={2 * i}\n" for i in range(50)))
  before = snapshot(trained)
  assert run.main(argv(f"train.steps={STEPS}", "data.source=text", f"data.path={corpus}",
                       workdir=trained, flags=["--resume"])) == 2
  line = error_line(capsys)
  assert "data.path='', current config has " + repr(str(corpus)) in line, line
  assert "data.source='arithmetic', current config has 'text'" in line, line
  assert snapshot(trained) == before


@pytest.mark.slow
def test_the_quickstart_pretrains_then_converts_and_resumes_either_stage(tmp_path, capsys):
  """configs/quickstart.py, shrunk: stage 1 (ar) trains into <workdir>/pretrain and is
  exported there; stage 2 (fast_dllm_v2) starts from that export exactly as a run with
  `init_from` set to it does (the same losses); `--resume` skips a finished stage 1 and
  continues stage 2; a stage 1 cut short is resumed before stage 2 starts."""
  two = ["--config", os.path.join(REPO, "configs", "quickstart.py"), "--no-progress"]
  sets = [x for item in [*TINY, "pretrain.steps=2", "train.steps=2"] for x in ("--set", item)]
  workdir = tmp_path / "run"
  assert run.main([*two, *sets, "--workdir", str(workdir)]) == 0
  hf = workdir / "pretrain" / "hf"
  assert checkpoint_steps(workdir / "pretrain") == [2] and (hf / "config.json").exists()
  direct = tmp_path / "direct"
  assert run.main(argv("objective.name=fast_dllm_v2", "train.steps=2", "train.lr=1e-3",
                       f"init_from={hf}", workdir=direct)) == 0
  assert [r["loss"] for r in rows(workdir)] == [r["loss"] for r in rows(direct)]
  first = snapshot(workdir / "pretrain")
  more = [*sets, "--set", "train.steps=4", "--allow-changes"]
  assert run.main([*two, *more, "--workdir", str(workdir), "--resume"]) == 0
  assert rows(workdir)[-1]["step"] == 4
  assert {p: h for p, h in snapshot(workdir / "pretrain").items() if "hf" not in p} == {
      p: h for p, h in first.items() if "hf" not in p}  # stage 1 untouched
  # Stage 1 stopped after its checkpoint at step 2 of 3, before stage 2 began: --resume
  # finishes stage 1, then runs stage 2 from its start.
  cut = tmp_path / "cut"
  three = [*sets, "--set", "pretrain.steps=3", "--workdir", str(cut)]
  assert run.main([*two, *three]) == 0
  for gone in ("2", "metrics.jsonl", "tb", "pretrain/3", "pretrain/hf"):
    shutil.rmtree(cut / gone) if (cut / gone).is_dir() else (cut / gone).unlink()
  assert run.main([*two, *three, "--resume"]) == 0
  assert [r["step"] for r in rows(cut / "pretrain")] == [2, 3]
  assert [r["step"] for r in rows(cut)] == [2] and checkpoint_steps(cut) == [2]
