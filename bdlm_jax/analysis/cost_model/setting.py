"""What the projection assumes: the hardware, the modelling choices, the models and lengths.

Every constant lives here and the report prints them all next to its results.
"""

import csv
import dataclasses
import os
import runpy
import statistics

from bdlm_jax.analysis.step_report import GB, META_ROW_BYTES
from bdlm_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str = "16x H200 (2 nodes x 8, NVLink 4 + 8x400G NDR InfiniBand per node)"
  nodes: int = 2
  gpus_per_node: int = 8
  peak_tflops: float = 989.0  # dense bf16 peak, for MFU
  matmul_tflops: float = 600.0  # achieved dense bf16 GEMM (~60% of the 989 TFLOP/s peak)
  attention_tflops: float = 400.0  # achieved flash attention fwd+bwd, tiles skipped (FA3-class)
  nvlink_gb_s: float = 360.0  # achieved GPU->GPU, one direction (900 GB/s bidirectional link)
  nvlink_alpha_us: float = 10.0
  ib_gb_s: float = 45.0  # achieved per GPU, one direction (one 400 Gb/s NIC per GPU)
  ib_alpha_us: float = 25.0
  # GPU <-> host memory, one direction, what `model.remat=offload` copies the saved residuals
  # over (an assumption): PCIe Gen5 x16, 32 GT/s x 16 lanes = 63 GB/s per direction by the
  # PCI-SIG PCIe 5.0 spec, ~55 GB/s achieved, one GPU per link (`host_link_c2c`: GH200's).
  host_gb_s: float = 55.0
  host_gb_per_node: float = 2048.0  # a node's system memory (DGX H200: 2 TB)
  # A node's local NVMe, sequential read, what a DFlash run's precomputed target features
  # stream from (an assumption): 8 x 3.84 TB U.2 data drives per DGX H100/H200 (NVIDIA DGX
  # H100 datasheet), ~7 GB/s each for PCIe Gen4 x4 drives of that class (Samsung PM1733
  # datasheet: 7,000 MB/s), ~90% of 56 GB/s achieved across the RAID-0 array.
  disk_gb_s: float = 50.0
  # The chunked gated delta rule (conv included), fwd and bwd: an assumption, not measured
  # here nor fitted: flash-linear-attention-class kernels run 64-row tiles (K, V = 128) and a
  # serial state pass between chunks, well short of a GEMM; a quarter of `matmul_tflops`.
  delta_rule_tflops: float = 150.0
  # One chain step's cost beside its state's trip over the link (`nvlink_alpha_us` or
  # `ib_alpha_us` + 3 MiB at the link's bandwidth, as every hop of this model): the dependent
  # apply S = M S_in + N, one small kernel the next hop waits for. An assumption: CUDA's
  # launch-to-launch latency of dependent kernels is a few microseconds.
  chain_apply_us: float = 5.0
  hbm_gb: float = 141.0
  usable_fraction: float = 0.95  # what the allocator may use

  @property
  def num_gpus(self) -> int:
    return self.nodes * self.gpus_per_node

  @property
  def usable_bytes(self) -> float:
    return self.hbm_gb * GB * self.usable_fraction


@dataclasses.dataclass(frozen=True)
class Assumptions:
  tile_skipping: bool = True  # kernel skips fully masked tiles (False: every pair of each visit)
  ring_overlap: bool = True  # a ring hop hides under the same step's compute
  balanced_ring_steps: bool = False  # True: every rank's ring step takes its mean step time
  compute_bytes: int = 2  # bf16 activations, q/k/v and the all-gather/reduce-scatter payloads
  kv_grad_bytes: int = 4  # dK/dV travel in f32 (parallel.kv_grad_dtype), ring or all-gather
  meta_bytes_per_row: int = META_ROW_BYTES  # the int32 row metadata each K/V row travels with
  state_bytes_per_param: int = 16  # f32 params + f32 grads + Adam m and v
  attention_bwd_factor: float = 2.5  # flash backward = 2.5x forward (recomputes the scores)
  remat_forward: int = 1  # full remat re-runs each layer's linear forward once in the backward


SCENARIOS = {
    "default": Assumptions(),
    "balanced ring steps": Assumptions(balanced_ring_steps=True),
    "no ring overlap": Assumptions(ring_overlap=False),
    "no tile skipping": Assumptions(tile_skipping=False),
}


def h100(hw: Hardware) -> Hardware:
  """One node of 8 H100 SXM: the H200's compute die (same peak, same achieved GEMM and
  attention rates, a kernel calibration included) and NVLink 4, 80 GB of HBM, no InfiniBand."""
  return dataclasses.replace(
      hw, name="8x H100 SXM 80 GB (one node, NVLink 4: 900 GB/s bidirectional per GPU)",
      nodes=1, gpus_per_node=8, hbm_gb=80.0)


def host_link_c2c(hw: Hardware) -> Hardware:
  """A scenario: the same GPUs with a GH200's host link, NVLink-C2C at 450 GB/s per
  direction (900 GB/s total, NVIDIA's GH200 Grace Hopper Superchip datasheet)."""
  return dataclasses.replace(hw, name=f"{hw.name}, host link NVLink-C2C (GH200)",
                             host_gb_s=450.0)


def calibrate(hw: Hardware, kernel_csv: str | None) -> tuple[Hardware, str]:
  """Attention TFLOP/s from experiments/kernel_bench.py output: the median useful TFLOP/s of
  our Pallas kernel, forward + backward, on BDLM masks (the work a training step does); the
  peers' rows and causal sanity rows say nothing about our step."""
  if not kernel_csv:
    return hw, f"attention TFLOP/s: assumed constant {hw.attention_tflops}"
  with open(kernel_csv) as f:
    records = list(csv.DictReader(f))
  values = [float(r["useful_tflops"]) for r in records
            if (r.get("peer"), r.get("mode"), r.get("mask")) == ("pallas", "fwd+bwd", "bdlm")
            and r.get("useful_tflops")]
  if not values:
    raise SystemExit(f"{kernel_csv}: no timed pallas fwd+bwd row on a bdlm mask (is it "
                     f"experiments/kernel_bench.py output from a GPU?)")
  tflops = statistics.median(values)
  return (dataclasses.replace(hw, attention_tflops=tflops),
          f"attention TFLOP/s: {tflops:.1f}, median useful TFLOP/s of {len(values)} pallas "
          f"fwd+bwd rows on BDLM masks in {kernel_csv}")


# Shapes of the paper-class models in bdlm_jax's Llama-style block (Gemma 3 27B's dimensions,
# qk_norm, vocabulary and 5:1 local:global layers of window 1024, local RoPE base 10K; its
# GeGLU and sandwich norms are not modelled; Qwen3-30B-A3B's, every layer a mixture of
# experts, whose experts take at most 1.25x their fair share of a group's rows, so that the
# expert-parallel receive buffers are sized by that capacity, not by the worst case of every
# row at one GPU).
MODELS = {
    "llama3-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500000.0,
                             tie_embeddings=False, compute_dtype="bfloat16"),
    "gemma3-27b": ModelConfig(vocab_size=262208, d_model=5376, n_layers=62, n_heads=32,
                              n_kv_heads=16, head_dim=128, d_ff=21504, rope_theta=1e6,
                              qk_norm=True, tie_embeddings=True, compute_dtype="bfloat16",
                              layer_pattern="local,local,local,local,local,global",
                              sliding_window=1024, rope_local_theta=10000.0),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, d_ff=6144, moe_experts=128,
                                 moe_top_k=8, moe_d_ff=768, moe_norm_topk=True,
                                 moe_drop_tokens=True, moe_capacity_factor=1.25,
                                 rope_theta=1e6, qk_norm=True, tie_embeddings=False,
                                 compute_dtype="bfloat16"),
}
# Gated DeltaNet hybrids, projected apart from `MODELS` (cost_model.hybrid): Qwen3.5-27B's
# dimensions, as configs/qwen3_5_27b_fast_dllm_v2_256k.py gives them and sources them.
QWEN3_5_RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 3,
                              "configs", "qwen3_5_27b_fast_dllm_v2_256k.py")
GDN_MODELS = {
    "qwen3.5-27b": ModelConfig(**runpy.run_path(QWEN3_5_RECIPE)["QWEN3_5_27B"],
                               compute_dtype="bfloat16"),
}
SEQ_LENS = (128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024)
BLOCK_SIZES = (16, 64, 256)
OFFLOAD_TOLERANCE = 0.05  # how much slower than remat=full offload may be where full fits
SCALING_GPUS = (16, 32, 64, 128)  # the strong-scaling sweep, in nodes of `gpus_per_node`
SCALING_SEQ_LENS = (256 * 1024, 1024 * 1024)
