"""Two processes x 4 CPU devices on localhost train-step exactly like one process with 8.

Each worker (tests/parallel/multihost_worker.py) joins through the config path
(`initialize_distributed` with `parallel.distributed=true`), builds only the sequences its own
devices hold (`data_shard` + `make_batch` + `put_batch`) and reports loss and gradient norm of a
fixed step. Cross-process collectives on CPU use gloo.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from bdlm_jax.batch import make_batch
from bdlm_jax.parallel.mesh import data_shard, make_mesh, put_batch
from tests.parallel import multihost_worker as worker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _two_processes(strategy: str, data: int, seq: int):
  """Starts both workers; kills any still running when the block exits."""
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = [subprocess.Popen(
      [sys.executable, worker.__file__, str(i), str(port), strategy, str(data), str(seq)],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  try:
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


def _results(procs: list[subprocess.Popen]) -> list[dict]:
  outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  if any(p.returncode == worker.GLOO_UNAVAILABLE for p in procs):
    pytest.skip("gloo CPU collectives unavailable in this jaxlib: "
                + " ".join(err.strip().splitlines()[-1] for _, err in outputs if err.strip()))
  results = []
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{err[-3000:]}"
    results.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
  return results


def _single_process(strategy: str, data: int, seq: int) -> tuple[float, float]:
  cfg, tokens = worker.problem(strategy, data, seq)
  mesh = make_mesh(cfg)
  shard, n_shards, rows = data_shard(mesh, worker.GLOBAL_BATCH)
  assert (shard, n_shards, rows) == (0, 1, slice(0, worker.GLOBAL_BATCH))
  batch = put_batch(make_batch(cfg, tokens), mesh, worker.GLOBAL_BATCH, rows)
  return worker.loss_and_grad_norm(cfg, mesh, batch)


@pytest.mark.parametrize("data, seq, expected_rows", [
    (2, 4, [[0, 2], [2, 4]]),  # each host holds whole sequences: half the batch each
    (1, 8, [[0, 4], [0, 4]]),  # the seq ring spans both hosts: both feed every sequence
], ids=["seq_within_host", "seq_spans_hosts"])
def test_two_hosts_give_the_loss_and_grads_of_one(data, seq, expected_rows):
  assert jax.device_count() >= 8
  with _two_processes("csbp_ring", data, seq) as procs:
    loss, grad_norm = _single_process("csbp_ring", data, seq)  # while the workers start up
    results = _results(procs)
  assert [r["process_count"] for r in results] == [2, 2]
  assert [r["devices"] for r in results] == [8, 8]
  assert [r["rows"] for r in results] == expected_rows
  for r in results:
    assert r["loss"] == pytest.approx(loss, rel=1e-5)
    assert r["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
