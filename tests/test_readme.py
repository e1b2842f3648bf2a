"""Every command in the README's ```bash blocks runs: here, from a fresh folder holding only
what a clone has beside the package (so `bdlm_jax` must come from `pip install -e .`), with
`train.steps=2`; or where ELSEWHERE says. The ```python examples run here too. (Commands
quoted inline in the prose, such as the GPU install, are not read.)"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
FEWER_STEPS = " --set train.steps=2 --no-progress"  # appended to each `python run.py`

# Command prefix -> where it runs instead.
ELSEWHERE = {
    "python3 -m venv .venv": ".ci/run, in a fresh virtual environment (tests/test_ci.py)",
    ". .venv/bin/activate": ".ci/run",
    "pip install -r requirements.txt": ".ci/run",
    "pip install -e .": ".ci/run; this file checks the package it installs is the checkout",
    "python -m pytest -q tests": ".ci/run",
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
}


def fenced(language: str) -> list[tuple[str, str]]:
  """(section heading, body) of each ```language block."""
  with open(README) as f:
    sections = re.split(r"^## ", f.read(), flags=re.M)
  return [(section.splitlines()[0], body) for section in sections
          for body in re.findall(rf"^```{language}\n(.*?)^```", section, flags=re.M | re.S)]


def commands(block: str) -> list[str]:
  """The block's commands: continued lines joined, comments dropped, `a && b` split."""
  text = re.sub(r"\\\n\s*", "", block)
  lines = (line.split("  #")[0].strip() for line in text.splitlines())
  return [part.strip() for line in lines if line and not line.startswith("#")
          for part in line.split("&&")]


def run_here(block: str) -> list[str]:
  return [c for c in commands(block) if not c.startswith(tuple(ELSEWHERE))]


BLOCKS = {heading: body for heading, body in fenced("bash") if run_here(body)}
EXAMPLES = dict(fenced("python"))


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


@pytest.fixture
def fresh_folder(installed, tmp_path):
  """A clone's scripts and configs without the package beside them."""
  shutil.copy(os.path.join(REPO, "run.py"), tmp_path)
  shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs")
  shutil.copytree(os.path.join(REPO, "experiments"), tmp_path / "experiments",
                  ignore=shutil.ignore_patterns("results", "__pycache__"))
  return tmp_path


@pytest.mark.parametrize("heading", BLOCKS)
def test_readme_commands_run_from_a_fresh_folder(fresh_folder, heading):
  for command in run_here(BLOCKS[heading]):
    if command.startswith("python run.py"):
      command += FEWER_STEPS
    out = run(command, fresh_folder)
    assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("heading", EXAMPLES)
def test_readme_python_example_runs_from_a_fresh_folder(fresh_folder, heading):
  out = run(f"python -c {shlex.quote(EXAMPLES[heading])}", fresh_folder)
  assert out.returncode == 0, out.stderr[-3000:]


def test_each_command_not_run_here_is_still_in_the_readme():
  shown = [c for _, body in fenced("bash") for c in commands(body)]
  for prefix in ELSEWHERE:
    assert any(c.startswith(prefix) for c in shown), f"stale ELSEWHERE entry {prefix!r}"
