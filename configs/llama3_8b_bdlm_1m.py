"""Llama-3.1-8B as a block diffusion LM on one 1,048,576-token sequence a step, 16 devices, its
context extended at conversion from the 128K its RoPE scaling reaches to 1M.

  python run.py --config configs/llama3_8b_bdlm_1m.py --set mode=plan
  python run.py --config configs/llama3_8b_bdlm_1m.py --set mode=plan --set parallel.seq=8 \
      --set model.remat=offload_input --set plan.target=tpu:v5p:2x2x2   # the 8-device case
  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models llama3-8b \
      --lens 1048576 --strategies csbp_ring cp_ring --remat offload --set model.row_chunks=16

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; needs `pip install -r requirements-tpu.txt`, no TPU) and prints each
strategy's per-device peak; `--set plan.target=cpu` compiles on simulated CPU devices instead
(JAX_NUM_CPU_DEVICES=16). What makes 1M fit (docs/memory.md): the saved residuals of the 32
layers in host memory (`model.remat=offload`: 2 x 131,072 rows x 4096 x 2 B a layer, 69 GB in
all), each layer's row-wise work in 16 parts (`model.row_chunks`: no [131,072, 14,336] MLP
intermediate), attention in 512 x 512 tiles, the loss over 1024-row chunks, ZeRO-3 state.
On 8 devices a rank's residuals double (129 GiB), past the host memory XLA:TPU allows a chip:
`model.remat=offload_input` keeps the layer inputs alone there (69 GB) and re-runs each
layer's attention in the backward.

Context extension (docs/conversion_sft.md): Llama 3.1's config.json scales RoPE with
rope_type llama3, factor 8 over its original 8,192 positions (128K); this recipe keeps that
scaling's shape and sets factor 64, 8x further, for 1M. Starting from the folder, the run's
first lines say so ("model.rope_scaling was ..., now ..."), and its export writes the new
scaling back.

Random weights and the embedded data, so it compiles and runs from a fresh clone; for the real
model, uncomment `init_from` (a Hugging Face folder: the import adds the [MASK] row) and point
`data` at a tokenized corpus (`mode=prepare`, `data.source=tokens`).
"""

import json

from bdlm_jax.config import (Config, DataConfig, ModelConfig, ObjectiveConfig, ParallelConfig,
                             PlanConfig, TrainConfig)

LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 head_dim=128, d_ff=14336, rope_theta=500000.0, norm_eps=1e-5,
                 tie_embeddings=False)  # meta-llama/Llama-3.1-8B config.json, but its RoPE scaling
# Llama 3.1's rope_scaling (factor 8: 8,192 -> 128K positions) with the factor for 1M.
ROPE_1M = json.dumps(dict(rope_type="llama3", factor=64.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192))


def get_config() -> Config:
  return Config(
      model=ModelConfig(**LLAMA3_8B, rope_scaling=ROPE_1M, param_dtype="float32",
                        compute_dtype="bfloat16", remat="offload", row_chunks=16,
                        attention_chunk=512, logits_chunk=1024),
      data=DataConfig(source="arithmetic", seq_len=1 << 20),
      objective=ObjectiveConfig(name="bd3lm", block_size=64, mask_token_id=128255),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16),
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-5, warmup_steps=50, log_every=1,
                        ckpt_every=100),
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/Llama-3.1-8B",
  )
