"""Every command in the ```bash and ```python blocks of the README and of the docs pages that
hold commands (PAGES) runs, in reading order, in one fresh folder holding only what a clone has
beside the package (so `bdlm_jax` must come from `pip install -e .`), with `train.steps=2`; or
where ELSEWHERE says. One folder for all, as in a reader's clone, so two commands that write the
same workdir fail here. Where a command prints a figure that a page quotes or a claim that it
makes, the test checks it. (Commands quoted inline in the prose, such as the GPU install, are
not read.)"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the whole file: docs/tests.md, the fast tier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pages whose commands run, in reading order: the README's set-up first, then the docs
# pages in the order a reader follows them (a later command may use an earlier one's output).
PAGES = ("README.md", "docs/usage.md", "docs/conversion_sft.md", "docs/evaluate.md",
         "docs/train_dflash.md", "docs/scale.md", "docs/gpus_tpus.md", "docs/results/README.md")
# `python run.py` commands train 2 steps; the quickstart's two stages 2 each.
QUICKSTART = "python run.py --config configs/quickstart.py"
SCRATCH = "python run.py --config configs/quickstart_bd3lm.py"
SHORTER = {QUICKSTART: "--set pretrain.steps=2 --set train.steps=2"}

# Command prefix -> where it runs instead.
ELSEWHERE = {
    "python3 -m venv .venv": ".ci/run, in a fresh virtual environment (tests/test_ci.py)",
    ". .venv/bin/activate": ".ci/run",
    "pip install -r requirements.txt": ".ci/run",
    "pip install -e .": ".ci/run; this file checks the package it installs is the checkout",
    "python -m pytest -q -n 2 --dist loadfile tests": ".ci/run",
    "srun ": "needs SLURM; tests/parallel/test_multihost.py runs a two-process job",
    "python run.py --config configs/X.py": "X stands for one's own config; the other commands "
                                           "run the same options on configs/",
    "python experiments/scale_probe.py": "minutes of compiling at 8B scale; tests/experiments/"
                                         "test_scale_probe.py runs its --quick setting",
    "python experiments/parallel_bench.py": "minutes of compiling; tests/experiments/"
                                            "test_parallel_bench.py runs its tiny grid",
    "python experiments/cost_model.py": "needs the bench's results; tests/experiments/"
                                        "test_cost_model.py runs the model",
    "python experiments/window_traffic.py": "a minute and a half of compiling; tests/experiments/"
                                            "test_window_traffic.py runs its smoke grid",
    "python experiments/block_size_sweep.py": "trains 12 models (~25 minutes); it runs the "
                                              "loop and eval that tests/test_evaluate.py tests",
    "python experiments/quickstart_seeds.py": "the quickstart's full runs, ~5 minutes each; "
                                              "tests/experiments/test_quickstart_seeds.py runs "
                                              "a shortened one",
    "python experiments/recipe_plans.py": "compiles 27-30B recipes for XLA:TPU for minutes; "
                                          "tests/experiments/test_recipe_plans.py runs a tiny "
                                          "one",
    "python experiments/conversion_forms.py": "trains 9 models (~40 minutes): the loop, export "
                                              "and eval that other tests test; the forms' "
                                              "losses: tests/objectives/test_seed_fast_dllm_v2.py",
    "pip install -r requirements-eval.txt": ".ci/run",
    "python tests/harness_tasks/make.py": "tests/test_harness.py writes the local tasks alike",
    "python -m bdlm_jax.harness": "tests/test_harness.py runs lm-eval's command line offline on "
                                  "the local tasks (the standard tasks' data is not here)",
    "HF_ALLOW_CODE_EVAL=1 python -m bdlm_jax.harness": "HumanEval's data and code_eval are not "
                                                       "here",
}


def _read(page: str) -> str:
  with open(os.path.join(REPO, page)) as f:
    return f.read()


def fenced(language: str, pages=PAGES) -> list[tuple[str, str]]:
  """(page, body) of each ```language block of `pages`, in order."""
  return [(page, body) for page in pages
          for body in re.findall(rf"^```{language}\n(.*?)^```", _read(page), flags=re.M | re.S)]


def commands(block: str) -> list[str]:
  """The block's commands: continued lines joined, comments dropped, `a && b` split."""
  text = re.sub(r"\\\n\s*", "", block)
  lines = (line.split("  #")[0].strip() for line in text.splitlines())
  return [part.strip() for line in lines if line and not line.startswith("#")
          for part in line.split("&&")]


def run_here(block: str) -> list[str]:
  return [c for c in commands(block) if not c.startswith(tuple(ELSEWHERE))]


def in_order() -> list[tuple[str, str]]:
  """(command as its page writes it, as it runs here), in reading order: each ```bash
  block's (`python run.py` with fewer steps and held-out prompts: sampling 512 prompts takes
  ~25 s, and no figure checked here reads them), and each ```python block as `python -c`."""
  fence = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
  blocks = [block for page in PAGES for block in fence.findall(_read(page))]
  out = []
  for language, body in blocks:
    if language == "python":
      out.append((body, f"python -c {shlex.quote(body)}"))
      continue
    for c in run_here(body):
      shorter = SHORTER.get(c, "--set train.steps=2")
      out.append((c, f"{c} {shorter} --set eval.prompts=4 --no-progress"
                  if c.startswith("python run.py") else c))
  return out


def run(command: str, folder) -> subprocess.CompletedProcess:
  """`command` in `folder` as a shell runs it, `python` being this interpreter; run.py picks
  its simulated devices itself, as in a fresh shell."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
  return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """Checks that `import bdlm_jax` outside the checkout finds the checkout."""
  out = run("python -c 'import bdlm_jax; print(bdlm_jax.__file__)'", tmp_path_factory.mktemp("x"))
  assert out.returncode == 0, f"bdlm_jax is not installed (pip install -e .): {out.stderr}"
  assert out.stdout.strip() == os.path.join(REPO, "bdlm_jax", "__init__.py")


@pytest.fixture(scope="module")
def clone(installed, tmp_path_factory):
  """(folder, {README command: completed process}): `in_order()` run up to the first failure,
  in a folder holding a clone's scripts and configs without the package beside them."""
  folder = tmp_path_factory.mktemp("clone")
  shutil.copy(os.path.join(REPO, "run.py"), folder)
  shutil.copytree(os.path.join(REPO, "configs"), folder / "configs")
  shutil.copytree(os.path.join(REPO, "experiments"), folder / "experiments",
                  ignore=shutil.ignore_patterns("results", "__pycache__"))
  done = {}
  for readme_command, command in in_order():
    done[readme_command] = run(command, folder)
    if done[readme_command].returncode:
      break
  return folder, done


def printed(clone, readme_command: str) -> str:
  """What `readme_command` (as its page writes it) printed."""
  out = clone[1].get(readme_command)
  assert out is not None and out.returncode == 0, f"{readme_command!r} did not run here"
  return out.stdout


def last_row(folder, workdir: str) -> dict:
  with open(folder / workdir / "metrics.jsonl") as f:
    return json.loads(f.read().splitlines()[-1])


def test_every_docs_page_with_commands_is_run():
  """A new page's ```bash block is not silently skipped (```python ones in the design pages
  sketch an API on a checkpoint one does not have)."""
  docs = os.path.join(REPO, "docs")
  with_commands = {os.path.relpath(os.path.join(folder, name), REPO)
                   for folder, _, names in os.walk(docs) for name in names
                   if name.endswith(".md") and fenced("bash", [os.path.relpath(
                       os.path.join(folder, name), REPO)])}
  assert with_commands <= set(PAGES), sorted(with_commands - set(PAGES))


def test_readme_commands_run_in_order_in_one_fresh_folder(clone):
  _, done = clone
  for command, out in done.items():
    assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"
  assert list(done) == [c for c, _ in in_order()]  # each once, all of them


def test_quickstart_prints_what_the_readme_quotes_for_both_stages(clone):
  """The quoted lines, each stage's held-out metric and token count (the held-out set is
  fixed); the losses and accuracies need the full stages (~5 minutes), too long for the
  suite: experiments/quickstart_seeds.py runs them."""
  quoted = next(body for _, body in fenced("text") if body.startswith("trained"))
  pattern = (r"^trained \d+ steps: .*\nstage 1, ar \(\d+ steps, runs/quickstart/pretrain\): "
             r"held-out (\w+) .*?(\d+) tokens\).*\nstage 2, fast_dllm_v2 from it \(\d+ steps, "
             r"runs/quickstart\):\nheld-out (.*?) \d+\.\d+ nats.*?(\d+) tokens\).*\nsample: ")
  want = re.search(pattern, quoted, re.M)
  got = re.search(pattern, printed(clone, QUICKSTART), re.M)
  assert want and got and got.groups() == want.groups()


AR = ("python run.py --config configs/quickstart_bd3lm.py --workdir runs/quickstart_ar "
      "--set objective.name=ar")


def test_ar_eval_under_cp_ring_prints_the_eval_of_its_training(clone):
  """docs/evaluate.md: "every strategy gives the same number (tested to 1e-5)"."""
  folder, _ = clone
  evaluated = json.loads(printed(clone, f"{AR} --set mode=eval --set parallel.strategy=cp_ring "
                                        "--set parallel.seq=4").splitlines()[-1])
  trained = last_row(folder, "runs/quickstart_ar")
  assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)


def test_ar_scores_one_held_out_token_per_document_fewer_than_bd3lm(clone):
  """docs/evaluate.md: bd3lm's NELBO includes each document's first token, "1 token in ~N
  here"."""
  tokens = lambda text: int(re.search(r"(\d+) tokens\)", text).group(1))
  bd3lm, ar = tokens(printed(clone, SCRATCH)), tokens(printed(clone, AR))
  quoted = int(re.search(r"1 token in ~(\d+) here", _read("docs/evaluate.md")).group(1))
  assert bd3lm / (bd3lm - ar) == pytest.approx(quoted, rel=0.05)


def test_dflash_under_csbp_ring_logs_the_one_device_losses(clone):
  """docs/train_dflash.md: "Every layout ... gives the one-device loss (tested to 1e-5)"."""
  folder, _ = clone
  one, csbp = (last_row(folder, w) for w in ("runs/dflash_tiny", "runs/dflash_tiny_csbp"))
  for key in ("loss", "eval_loss"):
    assert csbp[key] == pytest.approx(one[key], rel=1e-5), key


def test_plan_prints_csbp_at_half_cps_attention_bytes_and_141_gb_on_cpu(clone):
  """README: CSBP moves "half the attention traffic of CP, exactly" (to within the rounding of the
  table's two significant figures, up to ~5%); docs/scale.md: unset, `plan.device_memory_gb`
  is an H200's 141 GB on a CPU."""
  text = printed(clone, "python run.py --config configs/tiny_csbp.py --set mode=plan")
  rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
  assert rows[0][-1] == "fits 141 GB |"
  column = rows[0].index("attention GB/step")
  sent = {row[0][2:]: float(row[column]) for row in rows[1:]}
  for transport in ("ring", "allgather"):
    assert sent[f"csbp_{transport}"] == pytest.approx(sent[f"cp_{transport}"] / 2, rel=0.06)
  assert sent["bp"] == 0 < sent["csbp_ring"]


def test_plan_chooses_the_fastest_projection_that_fits_which_is_bp_on_the_tiny_config(clone):
  """docs/scale.md: mode=plan picks the least projected step time among the strategies that
  fit and names the runner-up; on configs/tiny_csbp.py, latency-bound on H200s, that is bp."""
  lines = printed(clone, "python run.py --config configs/tiny_csbp.py --set mode=plan").splitlines()
  chosen = next(i for i, line in enumerate(lines) if line.startswith("chosen: "))
  assert lines[chosen].startswith("chosen: bp (projected ")
  assert lines[chosen + 1].startswith("runner-up: ")


def test_each_command_not_run_here_is_still_on_a_page():
  shown = [c for _, body in fenced("bash") for c in commands(body)]
  for prefix in ELSEWHERE:
    assert any(c.startswith(prefix) for c in shown), f"stale ELSEWHERE entry {prefix!r}"
