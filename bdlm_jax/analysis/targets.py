"""Where a plan compiles (`plan.target`): which compiler, for which devices.

  cpu             XLA:CPU on this host's CPU devices (simulated: JAX_NUM_CPU_DEVICES)
  tpu:<topology>  XLA:TPU ahead of time for a TPU topology's devices, e.g. tpu:v5p:2x2x4
                  (16 v5p chips): needs libtpu (requirements-tpu.txt), not a TPU. Compiled,
                  never run.
  gpu             XLA:GPU on a GPU host; a mesh larger than the host is presented by a mock
                  topology (`mock_num_gpu_processes`: N hosts like this one, collectives
                  mocked), so a 16-GPU step compiles on one GPU. Needs a visible GPU.

The mesh is built on the target's devices (`make_mesh(cfg, target.devices)`), so the real
train step compiles as it would there; `check` refuses what that compiler cannot build.
"""

import dataclasses
import functools
import os

import jax

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel.experts import check_dispatch_runs_here

GIB = 2**30
# HBM per device that XLA:TPU compiles against, by device kind: the "available HBM" of its
# out-of-memory error (jax exposes no memory figure for a topology's devices).
TPU_HBM_BYTES = {
    "TPU v4": 15.25 * GIB,       # a v4 topology's devices are its TensorCores
    "TPU v5 lite": 15.75 * GIB,  # v5e
    "TPU v5": 95.74 * GIB,       # v5p
    "TPU v6 lite": 31.25 * GIB,  # v6e (Trillium)
}
# The public name of a TPU device kind jax reports ("TPU v5" is a v5p chip, "TPU v5 lite" a
# v5e), for reports; a kind not listed prints as jax names it.
TPU_PUBLIC_NAMES = {"TPU v5": "TPU v5p", "TPU v5 lite": "TPU v5e", "TPU v6 lite": "TPU v6e"}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # plan.target
  platform: str  # cpu | tpu | gpu: the compiler's backend
  devices: tuple  # what the mesh is built on

  @property
  def compiler(self) -> str:
    return f"XLA:{self.platform.upper()}"

  @property
  def device_kind(self) -> str:
    return self.devices[0].device_kind

  @property
  def chip(self) -> str:
    """The device's public name (`TPU_PUBLIC_NAMES`), e.g. TPU v5p for jax's "TPU v5"."""
    return TPU_PUBLIC_NAMES.get(self.device_kind, self.device_kind)

  def describe(self, devices: int | None = None) -> str:
    """The compiler and (the first `devices` of) its devices, for a report's header."""
    how = {"cpu": "", "tpu": " ahead of time (compiled, not run)",
           "gpu": " (a mock topology beyond this host's GPUs: compiled, not run)"}
    return (f"{self.compiler}{how[self.platform]} for {devices or len(self.devices)} "
            f"{self.chip} devices (plan.target={self.name})")

  def memory_bytes(self) -> float | None:
    """One device's memory where the target knows it: a TPU chip's HBM (`TPU_HBM_BYTES`),
    what a GPU reports; None for CPU."""
    if self.platform == "tpu":
      return TPU_HBM_BYTES.get(self.device_kind)
    if self.platform == "gpu":
      return float((self.devices[0].memory_stats() or {}).get("bytes_limit", 0)) or None
    return None


def platform_of(name: str) -> str:
  """The backend `plan.target=name` compiles with (cpu, tpu or gpu), without resolving it."""
  return name.split(":")[0]


def check(cfg: Config, platform: str) -> None:
  """Refuses, with the setting to change, a step `platform`'s compiler cannot build."""
  if platform == "tpu" and cfg.model.attention_impl == "pallas":
    raise ConfigError("model.attention_impl=pallas is a Triton (GPU) kernel, which XLA:TPU "
                      "cannot compile; set model.attention_impl=splash (or xla) for a TPU target")
  if platform == "gpu" and cfg.model.attention_impl == "splash":
    raise ConfigError("model.attention_impl=splash is a TPU (Mosaic) kernel, which XLA:GPU "
                      "cannot compile; set model.attention_impl=pallas (or xla) for a GPU target")
  check_dispatch_runs_here(cfg, platform)


def resolve(name: str, devices_needed: int = 1) -> Target:
  """The target `plan.target=name` names; for `gpu`, a mesh of `devices_needed` decides how
  many hosts the mock topology presents."""
  if name == "cpu":
    return Target(name, "cpu", tuple(jax.devices("cpu")))
  if name == "gpu":
    return _gpu(devices_needed)
  if name.startswith("tpu:"):
    return _tpu(name)
  raise ConfigError(f"plan.target={name!r} is not one of cpu, gpu, tpu:<topology>")


@functools.cache
def _tpu(name: str) -> Target:
  from jax.experimental import topologies
  topology = name[len("tpu:"):]
  # Compile-only: no chip is claimed, so processes (test workers) may load libtpu together.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  except Exception as e:  # noqa: BLE001 (no libtpu, or a topology it does not know)
    raise ConfigError(
        f"plan.target={name!r}: XLA:TPU cannot describe topology {topology!r} ("
        f"{str(e).splitlines()[0]}); install libtpu (pip install -r requirements-tpu.txt) and "
        f"name one such as v5p:2x2x4, v6e:4x4 or v5e:2x2") from e
  return Target(name, "tpu", tuple(devices))


def _gpu(devices_needed: int) -> Target:
  """This host's GPUs, repeated by a mock topology up to `devices_needed`. The mock must be
  set before jax starts its GPU backend: run mode=plan in a fresh process."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  per_host = len([d for d in visible.split(",") if d.strip()]) if visible else 1
  hosts = -(-devices_needed // per_host)
  if hosts > 1:
    jax.config.update("mock_num_gpu_processes", hosts)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # compiles, allocates nothing
  try:
    devices = jax.devices("gpu")
  except RuntimeError as e:
    jax.config.update("mock_num_gpu_processes", 0)  # nothing to mock
    raise ConfigError("plan.target=gpu needs a visible GPU, and jax sees none here; use "
                      "plan.target=cpu or tpu:<topology>") from e
  if len(devices) < devices_needed:
    raise ConfigError(
        f"plan.target=gpu: the mesh needs {devices_needed} GPUs and jax presents "
        f"{len(devices)}; the mock topology repeats this host {hosts} times only if set "
        f"before jax starts (run mode=plan in a fresh process) and assumes "
        f"{per_host} GPU(s) per host (CUDA_VISIBLE_DEVICES)")
  return Target("gpu", "gpu", tuple(devices[:devices_needed]))  # a mesh of all it is given
