"""Qwen3.5-27B converted from AR to a block diffusion LM: the seed's conversion recipe (Turbo-dLLM
0.1.6, `dllm_parallel/recipes/runs/qwen3-8-27b-fast-dllm-v2-256k.yaml`) on 16 TPU v5p chips.
As the recipe: one 262,144-token row a step, 1000 steps; Fast-dLLM v2 as the seed trains it
(blocks of 256, complementary masks, a block's first token scored on the noisy row, the [MASK]
logit kept, t independent per block in [0.001, 1], unit weights); the data one continuous
packed stream (`data.segment_ids=false`: attention and the Gated DeltaNet state cross
documents, as the seed's `data/prepare.py` ~100 concatenates them); AdamW on every parameter,
betas 0.9 / 0.999, eps 1e-5, weight decay 0.01, clip 1.0, lr 1e-6 with the seed's schedule
(40 warm-up steps from 1e-7, then a cosine toward 1e-7 over 1000 steps); launch seed 2026.
`tests/test_seed_recipes.py` checks these against the recipe file.
Ours, not the recipe's: context-sharded block parallelism (csbp_ring) over 16 devices. 48 of
the 64 layers are Gated DeltaNet: their state crosses devices by the chain of
parallel/recurrence.py, never their rows (docs/gdn.md).

  python run.py --config configs/qwen3_5_27b_fast_dllm_v2_256k.py --set mode=plan

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; `pip install -r requirements-tpu.txt`, no TPU); `--set plan.target=cpu`
compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES=16). Its figures per device (what the
device allocates, what is live at its peak, the compiler's peak, the bound, host bytes):

  python experiments/recipe_plans.py --config configs/qwen3_5_27b_fast_dllm_v2_256k.py \
      --strategies csbp_ring --timeout 3000

into experiments/results/recipe_plans.md (docs/gdn.md quotes it).

Random weights and the embedded data, so it compiles and runs from a fresh clone; for the real
model, uncomment `init_from` (the Hugging Face folder: `import_hf` reads `qwen3_5` text
weights) and point `data` at a tokenized corpus (`mode=prepare`, `data.source=tokens`).

Where this differs from the seed's recipe (files of the seed's package):
* Hardware and memory: the seed runs 2 nodes x 8 H200 (TP 2 with sequence parallelism, CP 8,
  BP 8), DeepSpeed ZeRO-2 and full activation checkpointing (the yaml's `topology`,
  `optimizer.backend`, `training.activation_checkpointing`); here 16 TPU v5p, csbp_ring, remat
  offload with 16 row chunks. The loss is the same.
* Precision: the seed holds the model in bf16 (`model.dtype`); here float32 parameters and
  optimiser state, bfloat16 compute.
* Rows: the seed cuts one continuous token stream into rows; our packing fills each row with
  whole documents first-fit and pads the rest (padding attends to nothing and is never scored).
* [MASK]: the seed appends `<|mask|>` at id len(tokenizer)
  (core/models/backbones/qwen3_8/executor.py ~128-152); here 248319, also a row no token uses.
* Draws: torch's generator there, jax keys here (the same distributions;
  tests/objectives/test_seed_fast_dllm_v2.py feeds both the same draws).
`--set data.segment_ids=true` keeps each document its own segment instead (beyond the seed):
attention stays inside it and the Gated DeltaNet state and conv restart at its start, on every
rank and across the chain (docs/gdn.md).
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
      # One continuous packed stream a row, as the seed trains (no document boundaries)
      data=DataConfig(source="arithmetic", seq_len=1 << 18, segment_ids=False),
      # The seed's recipe (Turbo-dLLM 0.1.6, recipes/runs/qwen3-8-27b-fast-dllm-v2-256k.yaml,
      # defaults from training/run_spec.py ~155-165): fast_dllm_v2 as the seed scores it
      # (a block's first token on the noisy row, the [MASK] logit kept, t independent per
      # block, eps 0.001), blocks of 256, unit loss weights.
      # [MASK]: the seed appends `<|mask|>` at id len(tokenizer) (core/models/backbones/
      # qwen3_8/executor.py ~128-152); 248319, the padded vocabulary's last row, is likewise a
      # row no token uses. With the real tokenizer set len(tokenizer) to match its checkpoints.
      objective=ObjectiveConfig(name="fast_dllm_v2", block_size=256, mask_token_id=248319,
                                loss_weight="unit", eps_min=1e-3, boundary_row="noisy",
                                keep_mask_logit=True, antithetic=False),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16),
      # AdamW on one parameter group (every weight decayed), betas 0.9 / 0.999, eps 1e-5,
      # weight decay 0.01, clip 1.0; lr 1e-6, the seed's cosine: 40 warm-up steps from 1e-7,
      # then 1000 decay steps toward 1e-7; 1000 steps of one sequence; launch seed 2026.
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-6, warmup_steps=40, min_lr_ratio=0.1,
                        schedule="seed_cosine", b1=0.9, b2=0.999, eps=1e-5, weight_decay=0.01,
                        decay_vectors=True, grad_clip=1.0, log_every=1, ckpt_every=100),
      seed=2026,
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/Qwen3.5-27B",
  )
