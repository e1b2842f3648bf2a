""".ci/run: installs the requirements and this checkout, runs the tests, fails when they do."""

import os
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = "-m pytest -q -n 2 --dist loadfile tests"  # .ci/run's, after `python`

# `python3 -m venv DIR` makes a venv whose `activate` puts the stub `python` first on PATH;
# that `python` logs its arguments and exits $PYTEST_EXIT for pytest, 0 for anything else.
FAKE_PYTHON3 = """#!/bin/sh
mkdir -p "$3/bin"
echo "PATH=$STUBS:\\$PATH" > "$3/bin/activate"
"""
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$LOG"
case "$*" in "-m pytest"*) exit "$PYTEST_EXIT";; esac
"""


def run_ci(tmp_path, pytest_exit: int):
  """Runs a copy of .ci/run under tmp_path with stub Pythons: (exit code, commands run)."""
  shutil.copytree(os.path.join(REPO, ".ci"), tmp_path / ".ci")
  stubs = tmp_path / "stubs"
  stubs.mkdir()
  for name, text in [("python3", FAKE_PYTHON3), ("python", FAKE_PYTHON)]:
    (stubs / name).write_text(text)
    (stubs / name).chmod(stat.S_IRWXU)
  env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", STUBS=str(stubs),
             LOG=str(tmp_path / "log"), PYTEST_EXIT=str(pytest_exit))
  out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True,
                       text=True, timeout=60)
  return out.returncode, (tmp_path / "log").read_text().splitlines()


@pytest.mark.parametrize("pytest_exit", [0, 1, 5], ids=["passed", "failed", "no_tests"])
def test_ci_fails_unless_tests_ran_and_passed(tmp_path, pytest_exit):
  code, commands = run_ci(tmp_path, pytest_exit)
  assert code == pytest_exit
  assert commands[-1] == TESTS


def test_ci_installs_the_checkout_before_testing(tmp_path):
  _, commands = run_ci(tmp_path, 0)
  install = commands.index("-m pip install -q -e .")
  assert commands.index("-m pip install -q -r requirements.txt") < install
  assert commands.index("-m pip install -q -r requirements-tpu.txt") < install  # XLA:TPU
  # The seed's package, oracle of the test_seed_* files, without its dependencies
  assert commands.index("-m pip install -q --no-deps -r requirements-seed.txt") < install
  # lm-evaluation-harness, for tests/test_harness.py
  assert commands.index("-m pip install -q -r requirements-eval.txt") < install
  assert install < commands.index(TESTS)


def test_the_readme_gives_ci_s_test_command():
  with open(os.path.join(REPO, "README.md")) as f:
    assert f"python {TESTS}\n" in f.read()


def test_one_test_file_runs_with_plain_pytest_options():
  """The two workers are CI's choice (.ci/run), not pytest's configuration: without xdist,
  collecting one file must not fail on options only xdist knows."""
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--collect-only",
                        "tests/test_ci.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
