"""Two processes x 4 CPU devices on localhost train-step exactly like one process with 8.

Each worker (tests/parallel/multihost_worker.py) joins through the config path
(`initialize_distributed` with `parallel.distributed=true`), builds only the sequences its own
devices hold (`data_shard` + `make_batch` + `put_batch`) and reports the loss and every
gradient of a fixed step. Cross-process collectives on CPU use gloo.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from bdlm_jax.batch import make_batch
from bdlm_jax.parallel.mesh import data_shard, make_mesh, put_batch
from tests.parallel import multihost_worker as worker

pytestmark = pytest.mark.slow  # the whole file: docs/tests.md, the fast tier

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _two_processes(strategy: str, data: int, seq: int):
  """Starts both workers; kills any still running when the block exits.

  Their output goes to files, not pipes: a worker blocked on a full pipe (its gradients are
  hundreds of KB) would never reach the shutdown barrier its peer waits at.
  """
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  with contextlib.ExitStack() as files:
    logs = [[files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)]
            for _ in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, worker.__file__, str(i), str(port), strategy, str(data), str(seq)],
        cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        for i, (out, err) in enumerate(logs)]
    try:
      yield list(zip(procs, logs))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()


def _results(workers) -> list[dict]:
  procs = [p for p, _ in workers]
  for p in procs:
    p.wait(timeout=TIMEOUT_S)
  outputs = []
  for _, files in workers:
    for f in files:
      f.seek(0)
    outputs.append(tuple(f.read() for f in files))
  if any(p.returncode == worker.GLOO_UNAVAILABLE for p in procs):
    pytest.skip("gloo CPU collectives unavailable in this jaxlib: "
                + " ".join(err.strip().splitlines()[-1] for _, err in outputs if err.strip()))
  results = []
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{err[-3000:]}"
    results.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
  return results


def _single_process(strategy: str, data: int, seq: int) -> tuple[float, dict]:
  cfg, tokens = worker.problem(strategy, data, seq)
  mesh = make_mesh(cfg)
  shard, n_shards, rows = data_shard(mesh, worker.GLOBAL_BATCH)
  assert (shard, n_shards, rows) == (0, 1, slice(0, worker.GLOBAL_BATCH))
  batch = put_batch(make_batch(cfg, tokens), mesh, worker.GLOBAL_BATCH, rows)
  return worker.loss_and_grads(cfg, mesh, batch)


@pytest.mark.parametrize("data, seq, expected_rows", [
    (2, 4, [[0, 2], [2, 4]]),  # each host holds whole sequences: half the batch each
    (1, 8, [[0, 4], [0, 4]]),  # the seq ring spans both hosts: both feed every sequence
], ids=["seq_within_host", "seq_spans_hosts"])
def test_two_hosts_give_the_loss_and_grads_of_one(data, seq, expected_rows):
  assert jax.device_count() >= 8
  with _two_processes("csbp_ring", data, seq) as workers:
    loss, grads = _single_process("csbp_ring", data, seq)  # while the workers start up
    results = _results(workers)
  assert [r["process_count"] for r in results] == [2, 2]
  assert [r["devices"] for r in results] == [8, 8]
  assert [r["rows"] for r in results] == expected_rows
  for r in results:
    assert r["loss"] == pytest.approx(loss, rel=1e-5)
    assert sorted(r["grads"]) == sorted(grads)
    for path, ref in grads.items():
      np.testing.assert_allclose(r["grads"][path], ref, rtol=1e-5,
                                 atol=1e-6 * float(np.abs(ref).max()), err_msg=path)
