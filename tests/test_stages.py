"""Two stages and resume (docs/usage.md, "Two stages" and "Resume"): a first stage is finished
only when its export holds step `pretrain.steps`, whole; a second stage that has begun never
reads the first; a checkpoint named good is one verified or saved; folders that never
committed are named. The tiny quickstart (configs/quickstart.py), through run.py."""

import os
import shutil

import jax
import numpy as np
import pytest

import run
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.configure import load_config
from bdlm_jax.loop import EXPORTED_FROM, exported_step
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.train import abstract_state
from tests.checkpoint.test_manager import flip_bytes_in_largest_array_file
from tests.test_cli import (QUICKSTART, REPO, TINY, argv, checkpoint_steps, error_line, rows,
                            snapshot)

TWO_STAGES = os.path.join(REPO, "configs", "quickstart.py")
# Stage 1: 4 ar steps, checkpoints at 2 and 4, evaluated at 4; stage 2: 4 steps from it.
STAGED = [*TINY, "pretrain.steps=4", "train.steps=4", "train.eval_every=4", "eval.batches=1",
          "eval.prompts=2"]


def staged(workdir, *overrides, flags=()):
  args = ["--config", TWO_STAGES, "--no-progress", "--workdir", str(workdir), *flags]
  return [*args, *(x for item in [*STAGED, *overrides] for x in ("--set", item))]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """Both stages run through: pretrain/{2,4,hf} and the second stage's {2,4}."""
  workdir = tmp_path_factory.mktemp("stages") / "run"
  assert run.main(staged(workdir)) == 0
  return workdir


def copy(finished, tmp_path, stage_2=True):
  """A copy of the finished run; without `stage_2`, as stopped before the second began."""
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  if not stage_2:
    for name in ("2", "4", "metrics.jsonl", "tb"):
      path = workdir / name
      shutil.rmtree(path) if path.is_dir() else path.unlink()
  return workdir


def written_at(folder):
  return {name: os.stat(folder / name).st_mtime_ns for name in os.listdir(folder)}


def test_an_export_counts_as_stage_1_only_whole_and_at_its_recorded_step(tmp_path):
  """`exported_step`: the step `exported_from.json` records, where every file matches the
  folder's checksums.json; None where a file differs or nothing vouches for them."""
  from bdlm_jax.checkpoint.manager import write_manifest
  from etils import epath
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / EXPORTED_FROM).write_text('{"step": 4}')
  (hf / "model.safetensors").write_bytes(b"weights")
  assert exported_step(str(hf)) is None  # no checksums
  write_manifest(epath.Path(hf))
  assert exported_step(str(hf)) == 4
  (hf / "model.safetensors").write_bytes(b"weighs!")
  assert exported_step(str(hf)) is None


def stage_1_line(capsys):
  return next(line for line in capsys.readouterr().out.splitlines()
              if line.startswith("stage 1"))


def test_a_finished_stage_1_export_records_its_step_and_is_written_once(finished, tmp_path,
                                                                        capsys):
  """The export holds step 4 (exported_from.json, covered by its checksums); a resume with
  nothing left to train rewrites no file of it."""
  hf = finished / "pretrain" / "hf"
  assert exported_step(str(hf)) == 4 and (hf / EXPORTED_FROM).exists()
  workdir = copy(finished, tmp_path, stage_2=False)
  before, written = snapshot(workdir / "pretrain"), written_at(workdir / "pretrain" / "hf")
  assert run.main(staged(workdir, flags=["--resume"])) == 0
  assert snapshot(workdir / "pretrain") == before
  assert written_at(workdir / "pretrain" / "hf") == written  # not even rewritten alike
  assert [r["step"] for r in rows(workdir)] == [2, 4]
  assert stage_1_line(capsys).startswith(f"stage 1, ar (4 steps, {workdir}/pretrain): held-out")


def test_a_damaged_last_stage_1_step_is_trained_again_not_passed_off_as_finished(
    finished, tmp_path, capsys):
  """Case 1 of the issue. Stage 1 at step 4, not yet exported, step 4 damaged at the same
  size. Before: step 2 restored and exported as the finished stage 1, steps 3-4 never
  trained, and the summary quoted step 4's figures. Now step 4 is set aside, steps 3-4 train
  again from step 2, and the export is that step 4: the same losses as the run that was
  never damaged, and the summary's figures are the exported step's own."""
  workdir = copy(finished, tmp_path, stage_2=False)
  shutil.rmtree(workdir / "pretrain" / "hf")
  flip_bytes_in_largest_array_file(workdir / "pretrain" / "4")
  with pytest.warns(UserWarning, match=r"pretrain/4 is unusable \(DamagedCheckpoint.*restored "
                                       r".*pretrain/2 instead"):
    assert run.main(staged(workdir, flags=["--resume"])) == 0
  assert checkpoint_steps(workdir / "pretrain") == [2, 4]
  assert exported_step(str(workdir / "pretrain" / "hf")) == 4
  redone, first = rows(workdir / "pretrain"), rows(finished / "pretrain")
  assert [r["step"] for r in redone] == [2, 4]
  assert redone[-1]["loss"] == pytest.approx(first[-1]["loss"], rel=1e-6)
  assert [r["loss"] for r in rows(workdir)] == pytest.approx([r["loss"] for r in rows(finished)],
                                                             rel=1e-6)
  assert f"held-out NLL {redone[-1]['eval_loss']:.4f}" in stage_1_line(capsys)


def test_a_last_stage_1_step_without_checksums_is_not_taken_as_the_end(finished, tmp_path):
  """Its run stopped between saving step 4 and its checksums: step 4 could be damaged
  unseen, so it is set aside as 4.unverified and trained again from step 2."""
  workdir = copy(finished, tmp_path, stage_2=False)
  shutil.rmtree(workdir / "pretrain" / "hf")
  os.remove(workdir / "pretrain" / "4" / "checksums.json")
  with pytest.warns(UserWarning, match=r"pretrain/4 has no checksums.json: it cannot be "
                                       r"verified.*moved to .*pretrain/4.unverified"):
    assert run.main(staged(workdir, flags=["--resume"])) == 0
  assert (workdir / "pretrain" / "4.unverified").is_dir()
  assert exported_step(str(workdir / "pretrain" / "hf")) == 4


@pytest.fixture(scope="module")
def stopped_at_2(finished, tmp_path_factory):
  """Stage 1 stopped after its checkpoint at step 2 of 4, stage 2 not begun."""
  workdir = copy(finished, tmp_path_factory.mktemp("stopped"), stage_2=False)
  for name in ("4", "hf"):
    shutil.rmtree(workdir / "pretrain" / name)
  return workdir


@pytest.mark.parametrize("steps, flags, expected", [
    (1, ["--allow-changes"], "pretrain.steps=1 is below the step {w}/pretrain/2 reached (2 of "
                             "a schedule of 4 steps): the run cannot end at 1; set "
                             "pretrain.steps=4 (as trained), or at least 2 with --allow-changes"),
    (6, [], "pretrain.steps=4, current config has 6"),
])
def test_pretrain_steps_changed_on_resume_follows_one_rule_and_is_named(
    stopped_at_2, capsys, steps, flags, expected):
  """Case 2. Before: lowered below the step reached, stage 1 passed for finished and that
  step was exported without a word; raised, the refusal named train.steps. Now lowered below
  it is refused in one line even with --allow-changes; changed otherwise it is refused
  without --allow-changes; both name pretrain.steps. Nothing is written."""
  before = snapshot(stopped_at_2)
  code = run.main(staged(stopped_at_2, f"pretrain.steps={steps}", flags=["--resume", *flags]))
  line = error_line(capsys)
  assert code == 2
  assert expected.format(w=stopped_at_2) in line, line
  assert "train.steps=" not in line.replace("pretrain.steps=", ""), line
  assert {p: h for p, h in snapshot(stopped_at_2).items() if "tb" not in p} == {
      p: h for p, h in before.items() if "tb" not in p}


def test_a_begun_stage_2_resumes_without_stage_1(finished, tmp_path):
  """Case 3. Stage 1's folder deleted while stage 2 is at step 2 of 4. Before: --resume
  trained stage 1 again from step 0, without a word, only to export it. Now stage 2 resumes
  from its own checkpoint (the same losses as the uninterrupted run) and stage 1 is not
  read, nor written."""
  workdir = copy(finished, tmp_path)
  shutil.rmtree(workdir / "pretrain")
  shutil.rmtree(workdir / "4")
  with pytest.warns(UserWarning, match=r"stage 2 resumes from its own checkpoint .*/2: stage 1 "
                                       r"\(.*pretrain\) is not read"):
    assert run.main(staged(workdir, flags=["--resume"])) == 0
  assert not (workdir / "pretrain").exists()
  assert [r["loss"] for r in rows(workdir)] == pytest.approx([r["loss"] for r in rows(finished)],
                                                             rel=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
def test_a_state_restored_unverified_is_never_named_the_last_good_checkpoint(
    tmp_path, capsys):
  """Case 4. Step 4 lost its checksums.json and holds weights damaged to finite, enormous
  values: it restores unverified, every step after it is skipped, and the run stops. Before:
  "Last good checkpoint: .../4". Now it says that no checkpoint is known good and why."""
  workdir = tmp_path / "run"
  overrides = ["train.steps=4", "train.max_bad_steps=2"]
  assert run.main(argv(*overrides, workdir=workdir)) == 0
  cfg = load_config(QUICKSTART, TINY + overrides)
  with Checkpointer(str(workdir), cfg, save_every=1, max_to_keep=5, async_save=False) as ckpt:
    _, state, data_state = ckpt.restore(abstract_state(cfg, make_mesh(cfg)))
  shutil.rmtree(workdir / "4")
  with Checkpointer(str(workdir), cfg, save_every=1, max_to_keep=5, async_save=False) as ckpt:
    ckpt.save(4, state._replace(params=jax.tree.map(lambda w: w * np.float32(1e30),
                                                    state.params)), data_state, force=True)
    ckpt.wait()
  os.remove(workdir / "4" / "checksums.json")
  with pytest.warns(UserWarning, match="restored unverified"):
    code = run.main(argv("train.steps=8", "train.max_bad_steps=2", workdir=workdir,
                         flags=["--resume", "--allow-changes"]))
  line = error_line(capsys)
  assert code == 2
  assert "Last good checkpoint" not in line, line
  assert (f"No checkpoint is known good: {workdir}/4, restored unverified (no checksums.json), "
          f"may be the cause") in line, line


def uncommitted(trained_workdir, tmp_path):
  """A copy of a 4-step run whose step folders lost their commit markers."""
  workdir = tmp_path / "run"
  shutil.copytree(trained_workdir, workdir)
  for step in checkpoint_steps(workdir):
    os.remove(workdir / str(step) / "commit_success.txt")
  return workdir


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("four") / "run"
  assert run.main(argv("train.steps=4", workdir=workdir)) == 0
  return workdir


def test_resume_names_step_folders_that_never_committed(four_steps, tmp_path, capsys):
  """Case 5. Before: "holds no checkpoint (a mistyped --workdir?)" although steps 2 and 4
  were there."""
  workdir = uncommitted(four_steps, tmp_path)
  assert run.main(argv("train.steps=4", workdir=workdir, flags=["--resume"])) == 2
  line = error_line(capsys)
  assert "step folders 2, 4 have no commit_success.txt" in line, line
  assert "mistyped" not in line, line


def test_a_new_run_beside_uncommitted_folders_sets_them_aside_saying_so(four_steps, tmp_path):
  """Case 5. Before: a new run started beside them without a word and ended with "moved to
  2.corrupt; restored .../4 instead" although it restored nothing. Now it says what it found
  and does before step 1, and no line claims a restore."""
  workdir = uncommitted(four_steps, tmp_path)
  with pytest.warns(UserWarning) as warned:
    assert run.main(argv("train.steps=4", "train.eval_every=4", "eval.batches=1",
                         "eval.prompts=2", workdir=workdir, flags=["--resume-if-present"])) == 0
  said = [str(w.message) for w in warned if "commit marker" in str(w.message)]
  assert len(said) == 2 and all("the run starts from step 0" in s for s in said), said
  assert not any("instead" in str(w.message) for w in warned)
  assert {"2", "2.corrupt", "4", "4.corrupt"} <= set(os.listdir(workdir))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_an_error_during_training_prints_on_a_line_of_its_own(four_steps, tmp_path, capsys):
  """Item 10. Before: `...tok_s=1114]error: steps 5-6 had ...` on the progress bar's line."""
  workdir = tmp_path / "run"
  shutil.copytree(four_steps, workdir)
  args = [a for a in argv("train.steps=8", "train.lr=1e39", "train.max_bad_steps=2",
                          workdir=workdir, flags=["--resume", "--allow-changes"])
          if a != "--no-progress"]
  with pytest.warns(UserWarning):
    assert run.main(args) == 2
  err = capsys.readouterr().err
  assert any(line.startswith("error: steps 5-6 had a non-finite") for line in err.splitlines())


def test_a_two_stage_run_of_a_model_no_family_exports_is_refused_before_training(
    tmp_path, capsys):
  """Item 11. Stage 1 must be exported for stage 2 to start from it: a model that cannot be
  is refused before any step, not after stage 1 has trained."""
  workdir = tmp_path / "run"
  assert run.main(staged(workdir, "model.post_norms=true")) == 2
  line = error_line(capsys)
  assert "no Hugging Face family expresses this model" in line, line
  assert not (workdir / "pretrain").exists()


def test_a_one_stage_run_says_first_when_mode_export_will_refuse_its_model():
  """Item 11: configs/qwen3_5_tiny.py (no q/k norms) trains, but exports to no family."""
  from bdlm_jax.loop import _say_unexportable
  cfg = load_config(os.path.join(REPO, "configs", "qwen3_5_tiny.py"))
  with pytest.warns(UserWarning, match="this model trains, but mode=export will refuse it: no "
                                       "Hugging Face family"):
    _say_unexportable(cfg)


@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_a_kernel_interpreted_here_is_said(impl):
  """Item 9. Before: Splash trained at half the xla speed on CPU, without a word."""
  from bdlm_jax.loop import say_interpreted
  cfg = load_config(QUICKSTART, [f"model.attention_impl={impl}"])
  with pytest.warns(UserWarning, match=f"model.attention_impl={impl} runs in Pallas' interpret "
                                       f"mode on cpu"):
    say_interpreted(cfg)


def test_export_under_a_file_size_limit_is_one_line(four_steps, tmp_path, capsys):
  """Item 8. Before: a 15-line safetensors traceback."""
  import resource
  out = tmp_path / "hf"
  limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limit[1]))
  try:
    code = run.main(argv("train.steps=4", "mode=export", f"export.out_dir={out}",
                         workdir=four_steps))
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
  line = error_line(capsys)
  assert code == 2
  assert line == f"error: writing {out}/model.safetensors failed: File too large", line


def test_a_stage_1_without_a_checkpoint_of_its_last_step_is_not_exported(stopped_at_2):
  """Its last state was not judged good (a spike: docs/usage.md, Resume), so no checkpoint
  holds step pretrain.steps: the export refuses in one line rather than export step 2."""
  from bdlm_jax.checkpoint import CheckpointError
  from bdlm_jax.configure import pretrain_stage
  from bdlm_jax.loop import export_stage
  first = pretrain_stage(load_config(TWO_STAGES, STAGED))
  hf = stopped_at_2 / "pretrain" / "hf"
  with pytest.raises(CheckpointError, match="stage 1 ended with no checkpoint of its last step 4 "
                                            r".*latest 2\): it is not exported"):
    export_stage(first, str(stopped_at_2 / "pretrain"), str(hf))
  assert not hf.exists()
