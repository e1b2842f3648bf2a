"""Qwen3.5-27B converted from AR to a block diffusion LM, the seed paper's conversion recipe:
one 262,144-token sequence a step on 16 devices, Fast-dLLM v2 (blocks of 256, complementary
masks), context-sharded block parallelism (csbp_ring). 48 of its 64 layers are Gated DeltaNet:
their state crosses devices by the chain of parallel/recurrence.py, never their rows
(docs/gdn.md).

  python run.py --config configs/qwen3_5_27b_fast_dllm_v2_256k.py --set mode=plan

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; `pip install -r requirements-tpu.txt`, no TPU); `--set plan.target=cpu`
compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES=16). docs/gdn.md holds its figures.

Random weights and the embedded data, so it compiles and runs from a fresh clone; for the real
model, uncomment `init_from` (the Hugging Face folder: `import_hf` reads `qwen3_5` text
weights) and point `data` at a tokenized corpus (`mode=prepare`, `data.source=tokens`).
"""

from bdlm_jax.config import (Config, DataConfig, ModelConfig, ObjectiveConfig, ParallelConfig,
                             PlanConfig, TrainConfig)

# Qwen3.5-27B's text config.json (consistent third-party copies; the seed loads the same
# `qwen3_5` model type as "Qwen3.8-27B"): hidden 5120, 64 layers of which every 4th is full
# attention (24 query / 4 KV heads of 256, gated, q/k norms, RoPE on the first quarter of the
# head dim, theta 1e7), the other 48 Gated DeltaNet (16 key / 48 value heads of 128, conv 4),
# SwiGLU 17408, vocabulary 248,320, untied head.
QWEN3_5_27B = dict(vocab_size=248320, d_model=5120, n_layers=64, n_heads=24, n_kv_heads=4,
                   head_dim=256, d_ff=17408, qk_norm=True, attention_gate=True,
                   partial_rotary_factor=0.25, rope_theta=1e7, norm_eps=1e-6,
                   layer_pattern="gdn,gdn,gdn,global", gdn_key_heads=16, gdn_value_heads=48,
                   gdn_key_dim=128, gdn_value_dim=128, gdn_conv=4, tie_embeddings=False)


def get_config() -> Config:
  return Config(
      model=ModelConfig(**QWEN3_5_27B, param_dtype="float32", compute_dtype="bfloat16",
                        remat="offload", row_chunks=16, attention_chunk=512, logits_chunk=1024),
      data=DataConfig(source="arithmetic", seq_len=1 << 18),
      # The seed's recipe (recipes/runs/qwen3-8-27b-fast-dllm-v2-256k.yaml): fast_dllm_v2,
      # blocks of 256, unit loss weights, lr 1e-6 with 40 warm-up steps, 1000 steps.
      objective=ObjectiveConfig(name="fast_dllm_v2", block_size=256, mask_token_id=248319,
                                loss_weight="unit"),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16),
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-6, warmup_steps=40, log_every=1,
                        ckpt_every=100),
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/Qwen3.5-27B",
  )
