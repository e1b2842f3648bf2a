"""One process of the two-process test (tests/parallel/test_multihost.py).

  python tests/parallel/multihost_worker.py PROCESS_ID PORT STRATEGY DATA SEQ

Joins the job through the config (`parallel.distributed=true`), feeds only the sequences its
own devices hold (`data_shard` + `put_batch`), and prints one JSON line with the loss and the
global gradient norm. `problem()` is shared with the single-process reference in the test.
"""

import json
import os
import sys

import numpy as np

DEVICES_PER_PROCESS = 4
GLOBAL_BATCH = 4
GLOO_UNAVAILABLE = 77  # exit code: CPU cross-process collectives are missing


def problem(strategy: str, data: int, seq: int, **parallel):
  """(cfg, logical tokens [S, L]): a tiny BD3-LM step; the same on every process."""
  from bdlm_jax.config import Config
  from bdlm_jax.configure import replace
  cfg = replace(Config(),
                model=dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                           d_ff=64),
                data=dict(seq_len=64), objective=dict(block_size=4),
                parallel=dict(strategy=strategy, data=data, seq=seq, **parallel),
                train=dict(batch_size=GLOBAL_BATCH))
  tokens = np.random.default_rng(0).integers(0, 256, (GLOBAL_BATCH, 64), dtype=np.int32)
  return cfg, tokens


def loss_and_grads(cfg, mesh, batch, before_run=lambda: None):
  """(loss, {parameter path: gradient}) as a Python float and numpy arrays, for fixed params
  and key. Both come back replicated, so every process holds every gradient whole.

  `before_run` is called between compiling and running the step.
  """
  import jax

  from bdlm_jax.loss import loss_fn
  from bdlm_jax.params import init_params

  params = init_params(cfg, jax.random.key(0), mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  @jax.jit
  def step(params, batch):
    (loss, _), grads = jax.value_and_grad(
        lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh), has_aux=True)(params)
    return jax.lax.with_sharding_constraint((loss, grads), replicated)

  compiled = step.lower(params, batch).compile()
  before_run()
  loss, grads = compiled(params, batch)
  local = lambda x: np.asarray(x.addressable_data(0), np.float32)
  return float(local(loss)), {jax.tree_util.keystr(path): local(g)
                              for path, g in jax.tree_util.tree_leaves_with_path(grads)}


def _wait_for_all_processes() -> None:
  """Gloo gives up on a collective whose peers arrive > 30 s apart (one process may compile
  while the other loads the compilation cache, or the machine is loaded); meet first at a
  coordination-service barrier, whose timeout we choose. No public JAX API exposes it."""
  from jax._src import distributed
  distributed.global_state.client.wait_at_barrier("bdlm_step_compiled", 180_000)


def main(process_id: int, port: int, strategy: str, data: int, seq: int) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["JAX_NUM_CPU_DEVICES"] = str(DEVICES_PER_PROCESS)
  import jax
  jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")

  from bdlm_jax.batch import make_batch
  from bdlm_jax.parallel.mesh import data_shard, initialize_distributed, make_mesh, put_batch

  cfg, tokens = problem(strategy, data, seq, distributed=True,
                        coordinator_address=f"localhost:{port}", num_processes=2,
                        process_id=process_id)
  initialize_distributed(cfg)
  try:
    mesh = make_mesh(cfg)
  except Exception as e:  # noqa: BLE001 - report a missing backend feature, re-raise the rest
    if "gloo" in str(e).lower():
      print(f"gloo unavailable: {e}", file=sys.stderr)
      sys.exit(GLOO_UNAVAILABLE)
    raise
  shard, n_shards, rows = data_shard(mesh, GLOBAL_BATCH)
  local = make_batch(cfg, tokens[rows])
  batch = put_batch(local, mesh, GLOBAL_BATCH, rows)
  loss, grads = loss_and_grads(cfg, mesh, batch, before_run=_wait_for_all_processes)
  print(json.dumps(dict(process_id=process_id, process_count=jax.process_count(),
                        devices=jax.device_count(), shard=shard, n_shards=n_shards,
                        rows=[rows.start, rows.stop], loss=loss,
                        grads={k: g.tolist() for k, g in grads.items()})))
  jax.distributed.shutdown()


if __name__ == "__main__":
  pid, port, strategy, data, seq = sys.argv[1:]
  main(int(pid), int(port), strategy, int(data), int(seq))
