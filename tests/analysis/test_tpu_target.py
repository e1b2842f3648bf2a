"""plan.target=tpu:<topology>: the real train step compiled by XLA:TPU ahead of time for a small
topology's devices (libtpu, no TPU). Its ring and all-gather transports move exactly the
plan's attention bytes, its peak is the compiler's own and decides the plan's pick. Skipped
where libtpu is not installed (requirements-tpu.txt).

A tiny model in bf16 (the wire dtype the plan counts: at float32, XLA:TPU's default matmul
precision lets it send K/V as bf16), one compile per strategy, shared by the tests.
"""

import functools
import re

import pytest

pytest.importorskip("libtpu")

from bdlm_jax.analysis import buffer_assignment  # noqa: E402
from bdlm_jax.analysis import buffers  # noqa: E402
from bdlm_jax.analysis import plan_mode  # noqa: E402
from bdlm_jax.analysis import step_report as sr  # noqa: E402
from bdlm_jax.analysis import targets  # noqa: E402
from bdlm_jax.config import Config  # noqa: E402
from bdlm_jax.configure import override, replace  # noqa: E402
from bdlm_jax.errors import ConfigError  # noqa: E402
from bdlm_jax.parallel.mesh import make_mesh  # noqa: E402

TARGET = "tpu:v5e:2x2"  # 4 TPU v5e chips
TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
            attention_chunk=32, remat="full", compute_dtype="bfloat16")


def config(strategy="csbp_ring", **sections) -> Config:
  base = dict(model=TINY, data=dict(seq_len=128), objective=dict(block_size=16),
              parallel=dict(strategy=strategy, seq=4), train=dict(batch_size=1),
              plan=dict(target=TARGET))
  return replace(Config(), **{**base, **sections})


@functools.cache
def report(strategy="csbp_ring") -> sr.StepReport:
  cfg = config(strategy)
  return sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["csbp_ring", "cp_ring"])
def test_tpu_ring_moves_exactly_the_plans_attention_bytes(strategy):
  """XLA:TPU keeps bf16 K/V at 2 bytes and sends the ring's last dK/dV hop in bf16 (its only
  use is the bf16 K/V cotangent), both in the plan's TPU figure: every byte accounted for,
  the layer scan's and the ring's trip counts read from the loops' bounds."""
  r = report(strategy)
  assert r.attention_check == 1.0
  assert r.attention_collective_bytes["collective-permute"] == \
      sr.expected_attention_operand_bytes(config(strategy), "tpu")


@pytest.mark.slow
def test_tpu_allgather_moves_exactly_the_plans_attention_bytes():
  """XLA:TPU rewrites the transport's int32 metadata all-gathers as all-reduces of zeros but
  for the shard, and its dK/dV reduce-scatter as an all-reduce of the f32 input, none named:
  hlo_stats counts the first as the all-gather it is and credits both to the attention."""
  r = report("csbp_allgather")
  plan = sr.config_attention_traffic(config("csbp_allgather"))  # bf16 stays 2 bytes on TPU
  assert r.attention_check == 1.0
  assert r.attention_collective_bytes["all-gather"] == plan["all-gather"]
  assert r.attention_collective_bytes["all-reduce"] == plan["reduce-scatter"]


def test_csbp_sends_half_the_attention_bytes_of_cp_on_tpu():
  assert 2 * sum(report("csbp_ring").attention_collective_bytes.values()) == \
      sum(report("cp_ring").attention_collective_bytes.values())


@pytest.mark.slow
def test_tpu_peak_is_the_compilers_own_and_below_the_every_buffer_bound():
  r = report()
  assert r.compiler_peak_bytes is not None and r.peak_bytes == r.compiler_peak_bytes
  assert 0 < r.peak_bytes < r.bound_bytes
  assert r.host_bytes == 0  # nothing offloaded
  assert r.weight_collective_bytes["all-gather"] > 0  # ZeRO-3's weight gathers, chains counted


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["csbp_ring", "csbp_allgather"])
def test_splash_steps_compile_for_tpu_and_move_the_same_attention_bytes(strategy):
  """attention_impl=splash: the kernels compile through Mosaic inside the real step (ring
  steps, an all-gather), and the transport around them sends what it sends with xla."""
  cfg = config(strategy, model=dict(TINY, attention_impl="splash"))
  r = sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices))
  assert r.attention_check == 1.0
  assert r.attention_collective_bytes == report(strategy).attention_collective_bytes


def test_plan_names_the_compiler_the_chip_and_the_peak_its_pick_fits_by(monkeypatch):
  monkeypatch.setattr(sr, "compare_strategies",
                      lambda *_: [(s, report(s)) for s in ("cp_ring", "csbp_ring")])
  text = plan_mode.plan_report(config())
  assert "XLA:TPU ahead of time (compiled, not run) for 4 TPU v5e devices" in text
  assert "Peak = the compiler's own peak_memory_in_bytes" in text
  assert "| peak GB | bound GB |" in text
  assert "fits 16.9114 GB" in text  # v5e's 15.75 GiB of HBM, as XLA:TPU compiles against
  assert "fits = XLA:TPU's device figure against one TPU v5e's memory (15.75 GiB)" in text
  chosen = next(line for line in text.splitlines() if line.startswith("chosen: "))
  r = report("csbp_ring")
  assert chosen.startswith("chosen: csbp_ring (projected ")
  assert "(no model of a TPU v5e's time)" in chosen
  assert (f"fits: {r.device_allocated_bytes / sr.GB:.3g} GB on the device (XLA:TPU peak "
          f"{r.compiler_peak_bytes / sr.GB:.3g} GB) of 16.9114 GB") in chosen


def test_tpu_target_refuses_the_triton_kernel_and_names_splash():
  cfg = override(config(), ["model.attention_impl=pallas"])
  with pytest.raises(ConfigError, match="set model.attention_impl=splash"):
    sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices))


def test_an_unknown_topology_is_a_config_error():
  with pytest.raises(ConfigError, match="cannot describe topology 'v9z:2x2'"):
    targets.resolve("tpu:v9z:2x2")


@pytest.mark.slow
def test_offload_puts_the_saved_residuals_in_host_memory(tmp_path):
  """model.remat=offload: at least what each layer saves (its input and attention output in
  bf16, the f32 LSE, the int32 positions and row metadata and the f32 router row weight, per
  row) is compiled into host memory (XLA:TPU pads small arrays to its tiles, so it may hold
  more); remat=full keeps none there. The breakdown of the same compile finds them there:
  its host-resident buffers are the layer scan's stacks alone (a leading dim of the layer
  count), and they are the report's host bytes but for the few KiB more that XLA:TPU's
  memory_analysis counts in host memory beside them (35 KiB here, 30 KiB at 4x the rows and
  d_model: a fixed cost, not the residuals').

  The device's own figures leave them out: it allocates the default memory space's
  allocations (XLA's memory-usage report's total for that space), none of the host ones,
  and what is live at its peak is the breakdown's device bytes. (At these sizes the
  preallocated temp block, 8.4 MB, is several times the compiler's peak, 1.25 MB: XLA:TPU
  pads and aligns each small buffer.)"""
  cfg = config(model=dict(TINY, remat="offload"))
  offload = sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices),
                           dump_to=str(tmp_path))
  breakdown = buffers.read_dump(str(tmp_path), cfg, offload, "tpu")
  rows = 2 * 128 // 4  # [x_t ; x_0] over 4 ranks
  per_row = (TINY["d_model"] * 2 + TINY["n_heads"] * TINY["head_dim"] * 2
             + TINY["n_heads"] * 4 + 6 * 4 + 4)
  assert report().host_bytes == 0
  host = breakdown.by_category()[buffers.HOST]
  assert TINY["n_layers"] * rows * per_row <= host <= offload.host_bytes <= host + 64 * 1024
  stacks = [b for b in breakdown.buffers if b.category == buffers.HOST]
  assert stacks and all(b.shape.split("[")[1].startswith(f"{TINY['n_layers']},")
                        for b in stacks)
  assert 0 < breakdown.device_bytes <= offload.peak_bytes
  allocations, _ = buffer_assignment.read(str(tmp_path))
  in_host = sum(nbytes for nbytes, _, space in allocations.values() if space == "host")
  default_total = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)",
                            buffer_assignment.dumped(str(tmp_path), "-memory-usage-report.txt"))
  assert 0 < in_host <= offload.host_bytes  # memory_analysis counts a few KiB more
  assert offload.fit_bytes == offload.device_allocated_bytes == int(default_total.group(1))
  assert offload.device_live_bytes == breakdown.device_bytes <= offload.device_allocated_bytes


@pytest.mark.slow
def test_offload_period_keeps_a_steps_input_in_host_memory():
  """model.remat=offload_period, both layers one scan step: host memory holds one layer
  input a step with its row metadata, half of what offload_input keeps there (one a
  layer)."""
  reports = {}
  for remat, extra in (("offload_input", {}), ("offload_period", dict(scan_period=2))):
    cfg = config(model=dict(TINY, remat=remat, **extra))
    reports[remat] = sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices))
  rows = 2 * 128 // 4  # [x_t ; x_0] over 4 ranks
  per_row = TINY["d_model"] * 2 + 6 * 4 + 4
  host_input, host_period = (reports[r].host_bytes for r in ("offload_input", "offload_period"))
  assert TINY["n_layers"] * rows * per_row <= host_input
  assert rows * per_row <= host_period < host_input
  assert host_input - host_period >= rows * per_row


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["offload_input", "offload_period"])
def test_a_4_gib_layer_input_offloads_in_halves(remat):
  """XLA:TPU aborts compiling the copy to host of an array of exactly 4 GiB (libtpu 0.0.42.1):
  `residuals.keep_input` and `keep_step_input` offload such an array in two halves, and the
  step compiles, holding all of it in host memory (on a v5p chip: a v5e's 16 GB cannot hold
  the step)."""
  memory = _offloading_scan_memory(2, rows=1 << 19, width=4096, remat=remat,
                                   target="tpu:v5p:2x2x1")
  assert memory["host_bytes"] == 2 * (1 << 32)


def _one_chip(target: str):
  """A sharding that places an array on one chip of `target`."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  return NamedSharding(Mesh(targets.resolve(target).devices[:1], ("x",)), PartitionSpec())


def _offloading_scan_memory(layers: int, rows=8192, width=256, remat="offload_input",
                            target=TARGET):
  """memory_analysis() of the gradient of a layer scan whose per-layer input is offloaded to
  host memory (the layers' own policy, model.remat=offload_input; or each layer a scan step
  of its own under offload_period), one chip of `target`."""
  import jax
  import jax.numpy as jnp

  from bdlm_jax.kernels import residuals
  from bdlm_jax.models.transformer import remat_policy, step_remat

  device = _one_chip(target)

  def layer(x, w):
    x = (residuals.keep_step_input(x, offloaded=True) if remat == "offload_period"
         else residuals.keep_input(x, offloaded=True))
    return jnp.tanh(x @ w).astype(x.dtype), None

  policy = step_remat(remat) if remat == "offload_period" else remat_policy(remat)

  def loss(w, x):
    return jnp.sum(jax.lax.scan(policy(layer), x, w)[0])

  shapes = (jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=device),
            jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=device))
  return sr.compiled_memory(jax.jit(jax.grad(loss)).lower(*shapes).compile(), "tpu")


def test_xla_tpus_peak_counts_host_memory():
  """Why StepReport.peak_bytes takes the smaller of the compiler's peak and the bound when
  anything is offloaded: 6 more layers offload 6 more layer inputs, the device's buffers (the
  bound: every one live at once) stay put, and XLA:TPU's peak_memory_in_bytes grows with the
  host bytes, past the bound (at 32768 rows by 0.84 of them)."""
  two, eight = _offloading_scan_memory(2), _offloading_scan_memory(8)
  residual = 8192 * 256 * 2
  assert eight["host_bytes"] - two["host_bytes"] == 6 * residual
  bound = lambda m: (m["argument_bytes"] + m["temp_bytes"] + m["output_bytes"]
                     - m["alias_bytes"])
  assert bound(eight) - bound(two) < residual  # only the 6 more layers' weights
  assert eight["compiler_peak_bytes"] - two["compiler_peak_bytes"] > 3 * residual
  assert eight["compiler_peak_bytes"] > bound(eight) + eight["host_bytes"] / 2


def test_dot_flops_count_the_convolutions_xla_tpu_writes_matmuls_as():
  """XLA:TPU compiles a matmul as a `convolution` (dim_labels bf_io->bf): 7 loop steps of a
  [256, 512] x [512, 512] matmul, counted with the loop's trip count."""
  import jax
  import jax.numpy as jnp

  from bdlm_jax.analysis import hlo_stats

  device = _one_chip(TARGET)
  step = lambda x, w: jax.lax.fori_loop(0, 7, lambda i, x: jnp.tanh(x @ w), x)
  shapes = (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=device),
            jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=device))
  compiled = jax.jit(step).lower(*shapes).compile()
  assert "convolution(" in compiled.as_text()
  assert hlo_stats.dot_flops(compiled) == (7 * 2 * 256 * 512 * 512, 0.0)


@pytest.mark.parametrize("equation, shapes, flops", [
    # attention's scores: the batch axes (2 sequences x 8 heads) become spatial axes whose
    # window equals the lhs dilation (size=2x8 lhs_dilate=2x8): one tap each, not 16
    ("sqhd,skhd->shqk", ((2, 1024, 8, 128), (2, 2048, 8, 128)), 2 * 2 * 1024 * 2048 * 8 * 128),
    ("etd,edf->etf", ((16, 4096, 512), (16, 512, 1024)), 2 * 16 * 4096 * 512 * 1024)])
def test_dot_flops_count_a_batched_matmul_once_per_batch_element(equation, shapes, flops):
  import jax
  import jax.numpy as jnp

  from bdlm_jax.analysis import hlo_stats

  device = _one_chip(TARGET)
  compiled = jax.jit(lambda a, b: jnp.einsum(equation, a, b)).lower(
      *(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=device) for s in shapes)).compile()
  assert "lhs_dilate" in compiled.as_text()
  assert hlo_stats.dot_flops(compiled) == (flops, 0.0)
