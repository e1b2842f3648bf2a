"""Gemma-3-27B as a block diffusion LM on one 262,144-token sequence a step, 16 devices, with
its real 5 local : 1 global layer pattern (sliding window 1024).

  python run.py --config configs/gemma3_27b_bdlm_256k.py --set mode=plan
  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models gemma3-27b \
      --lens 262144 --strategies csbp_ring cp_ring --remat offload --set model.row_chunks=16

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; needs `pip install -r requirements-tpu.txt`, no TPU); `--set plan.target=cpu`
compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES=16). Local layers exchange only the K/V
rows their window reaches (docs/local_and_moe.md); the memory features are those of
configs/llama3_8b_bdlm_1m.py (docs/memory.md).

Random weights and the embedded data, so it compiles and runs from a fresh clone; for the
real model, uncomment `init_from` (a Hugging Face folder) and point `data` at a tokenized
corpus (`mode=prepare`, `data.source=tokens`).
"""

from bdlm_jax.config import (Config, DataConfig, ModelConfig, ObjectiveConfig, ParallelConfig,
                             PlanConfig, TrainConfig)

# google/gemma-3-27b-pt config.json (text_config). Its global layers' RoPE is linearly scaled
# (factor 8), which the Hugging Face import refuses today (checkpoint/hf_names.py): random
# weights only until it is supported; the memory figure does not depend on it.
GEMMA3_27B = dict(vocab_size=262208, d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16,
                  head_dim=128, d_ff=21504, qk_norm=True, post_norms=True,
                  scale_embeddings=True, query_pre_attn_scalar=168, mlp_activation="gelu_tanh",
                  layer_pattern="local,local,local,local,local,global", sliding_window=1024,
                  rope_theta=1e6, rope_local_theta=10000.0, norm_eps=1e-6, tie_embeddings=True,
                  # google/gemma-3-27b-pt's RoPE: global layers linear x8, local ones plain.
                  rope_scaling='{"factor": 8.0, "rope_type": "linear"}',
                  rope_local_scaling='{"rope_type": "default"}')


def get_config() -> Config:
  return Config(
      model=ModelConfig(**GEMMA3_27B, param_dtype="float32", compute_dtype="bfloat16",
                        remat="offload", row_chunks=16, attention_chunk=512, logits_chunk=1024),
      data=DataConfig(source="arithmetic", seq_len=1 << 18),
      objective=ObjectiveConfig(name="bd3lm", block_size=64, mask_token_id=262207),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16),
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-5, warmup_steps=50, log_every=1,
                        ckpt_every=100),
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/gemma-3-27b-pt",
  )
