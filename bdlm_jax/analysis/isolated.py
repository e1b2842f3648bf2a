"""One compile per fresh process: host memory is freed after each, a crash or a timeout is a
result rather than the end of a sweep, and nothing is cached between compiles (compile times
are real). Used by the compile-only experiments (scale_probe, memory_features,
memory_breakdown)."""

import json
import os
import signal
import subprocess
import sys

from bdlm_jax.analysis import targets


def worker_env(devices: int, target: str) -> dict:
  """The compile's environment: `devices` simulated CPU devices; for a TPU target, XLA:CPU as
  the runtime beside libtpu's compile-only client (concurrent jobs may load libtpu); for a GPU
  target, the GPU runtime (mocked beyond this host by `targets`)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  if targets.platform_of(target) == "tpu":
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  if targets.platform_of(target) == "gpu":
    del env["JAX_PLATFORMS"], env["JAX_NUM_CPU_DEVICES"]
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # it compiles; another process may run
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def run_worker(script: str, job: dict, devices: int, target: str, timeout_s: float) -> dict:
  """The JSON row `python script --worker <job>` prints last, run in a fresh process, or
  {'error': why not}."""
  try:
    done = subprocess.run([sys.executable, os.path.abspath(script), "--worker", json.dumps(job)],
                          env=worker_env(devices, target), capture_output=True, text=True,
                          timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return dict(error=f"compile timed out after {timeout_s:.0f} s")
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    return dict(error=crash_reason(done.returncode, done.stderr))
  return json.loads(lines[-1])


def crash_reason(returncode: int, stderr: str) -> str:
  """Why a worker ended without its row: the signal that killed it (SIGKILL without a word
  on stderr is, on Linux, the out-of-memory killer: the compile needed more host memory than
  the machine has), else its exit code and last line on stderr."""
  if returncode < 0:
    name = signal.Signals(-returncode).name
    hint = " (on Linux, usually the out-of-memory killer: the compile needed more host " \
           "memory than this machine has)" if -returncode == signal.SIGKILL else ""
    return f"killed by {name}{hint}"
  why = (stderr.strip().splitlines() or ["no output"])[-1]
  return f"crashed (exit {returncode}): {why}"
