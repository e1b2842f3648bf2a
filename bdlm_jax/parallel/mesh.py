"""The device mesh and how arrays are placed on it.

Axes: `data` (replicas), `fsdp` (replicas whose parameters and optimiser state are sharded),
`seq` (one sequence split over ranks). Sequences are split over data*fsdp; rows over seq.
Parameters, gradients and optimiser moments are sharded over fsdp*seq (zero3.py).
"""

import functools
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError

AXES = ("data", "fsdp", "seq")
BATCH_AXES = ("data", "fsdp")


def check_config(cfg: Config) -> None:
  """Sequences split over data*fsdp, each micro-batch alike."""
  p, t = cfg.parallel, cfg.train
  ways = p.data * p.fsdp * t.grad_accum
  if t.batch_size % ways:
    raise ConfigError(f"train.batch_size={t.batch_size} must be divisible by parallel.data"
                      f"*parallel.fsdp*train.grad_accum={ways}")


def make_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
  """The data x fsdp x seq mesh on `devices` (default `jax.devices()`; a compile-only target
  passes its own, e.g. a TPU topology's: bdlm_jax.analysis.targets)."""
  p = cfg.parallel
  shape = (p.data, p.fsdp, p.seq)
  need = int(np.prod(shape))
  devices = jax.devices() if devices is None else list(devices)
  have = len(devices)
  if need > have:
    raise ConfigError(
        f"mesh data*fsdp*seq = {p.data}*{p.fsdp}*{p.seq} = {need} needs {need} devices, but only "
        f"{have} are visible; lower parallel.* or expose more devices (on CPU: "
        f"JAX_NUM_CPU_DEVICES={need})")
  if jax.process_count() > 1 and need != have:
    raise ConfigError(f"on several hosts the mesh must use all {have} devices, got {need}")
  if need < have:
    _say_devices_left_idle(f"{p.data}*{p.fsdp}*{p.seq}", need, have)
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:need])


@functools.cache
def _say_devices_left_idle(shape: str, need: int, have: int) -> None:
  """Logs, once per process and mesh shape, that `parallel.*` asks for fewer devices than
  there are: often a slip (parallel.seq=3 on 8) that would otherwise show only as a slow run."""
  logging.getLogger(__name__).warning(
      "the mesh data*fsdp*seq = %s uses %d of the %d visible devices; the other %d stay idle",
      shape, need, have, have - need)


def row_sharding(mesh) -> NamedSharding:
  """[S, R] batch arrays: sequences over data*fsdp, rows over seq."""
  return NamedSharding(mesh, P(BATCH_AXES, "seq"))


def initialize_distributed(cfg: Config) -> None:
  """Joins a multi-host job: explicit config values win, else JAX reads the environment
  (SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS / process count / id)."""
  p = cfg.parallel
  if not p.distributed:
    return
  kwargs = {}
  if p.coordinator_address:
    kwargs["coordinator_address"] = p.coordinator_address
  if p.num_processes > 0:
    kwargs["num_processes"] = p.num_processes
  if p.process_id >= 0:
    kwargs["process_id"] = p.process_id
  jax.distributed.initialize(**kwargs)


def data_shard(mesh, global_batch: int) -> tuple[int, int, slice]:
  """(shard index, shard count, global batch slice) of the sequences this process feeds.

  Processes whose devices hold the same sequences (the seq axis may span hosts) read the
  same data shard; each host feeds only the rows its own devices hold.
  """
  shape = (global_batch, mesh.shape["seq"])
  per_process: dict[int, set] = {}
  for device, index in row_sharding(mesh).devices_indices_map(shape).items():
    start, stop, _ = index[0].indices(global_batch)
    per_process.setdefault(device.process_index, set()).add((start, stop))
  ranges = {p: (min(r[0] for r in rs), max(r[1] for r in rs)) for p, rs in per_process.items()}
  distinct = sorted(set(ranges.values()))
  mine = ranges[jax.process_index()]
  return distinct.index(mine), len(distinct), slice(*mine)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole of `x` on this host, also where other hosts hold some of its shards."""
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def put_batch(local_batch, mesh, global_batch: int, local_slice: slice):
  """Host arrays holding sequences `local_slice` of the global batch -> global jax Arrays."""
  sharding = row_sharding(mesh)

  def put(x):
    def shard(index):
      start, stop, _ = index[0].indices(global_batch)
      return x[(slice(start - local_slice.start, stop - local_slice.start), *index[1:])]

    return jax.make_array_from_callback((global_batch, *x.shape[1:]), sharding, shard)

  return jax.tree.map(put, local_batch)
