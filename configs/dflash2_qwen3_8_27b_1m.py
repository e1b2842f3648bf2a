"""DFlash2, the seed paper's Qwen3.8-27B recipe (docs/dflash.md, "DFlash2"): the
Qwen3.8-27B-DFlash2 drafter (block 8, 2048 locality anchors, D-PACE weights with the LK lambda
loss, block convolutions and the candidate selector) trained on the verifier's features read
from disk, on 8 devices laid out as the seed lays them out: four data-parallel groups of 2
(`parallel.data=4`, `parallel.seq=2`: the seed's CP 2 / BP 2 on one axis of 2, DP 4), each
training one 1,048,576-token sequence a step under context-sharded block parallelism
(csbp_ring), bf16 weights under AdamW, no activation checkpointing.

  python run.py --config configs/dflash2_qwen3_8_27b_1m.py --set mode=plan
  python experiments/recipe_plans.py --config configs/dflash2_qwen3_8_27b_1m.py \
      --strategies csbp_ring cp_replicated_drafts

What the seed states (its recipe file) is marked RECIPE; the drafter's and the verifier's
widths are in neither the wheel nor the recipe but in the checkpoints' Hugging Face configs,
which the seed loads at run time: those here are ASSUMED, a Qwen3.5-27B-class verifier (as
analysis/cost_model/dflash.py's DFLASH2_RECIPES["qwen3.8-27b"]) and a drafter of the Muse
recipe's shape at that width. A published drafter's own values replace them with
`drafter.init_from` (docs/train_dflash.md).
"""

from bdlm_jax.config import (Config, DataConfig, DrafterConfig, ModelConfig, ObjectiveConfig,
                             ParallelConfig, PlanConfig, TrainConfig)

# The seed: Turbo-dLLM 0.1.6 (`pip download turbo-dllm==0.1.6 --no-deps`); RECIPE is its
# dllm_parallel/recipes/runs/dflash2-qwen3-8-27b-1m.yaml, line numbers of that file (drafter
# incoai/Qwen3.8-27B-DFlash2 @ dedf8df6, verifier Qwen/Qwen3.8-27B @ 1d4bf0f2, lines 6-10).

# The verifier (the frozen target): only its width, vocabulary and head matter here (its layers
# are replaced by the features). ASSUMED: Qwen3.5-27B's text config (configs/
# qwen3_5_27b_fast_dllm_v2_256k.py, whose `qwen3_5` model type the seed loads as
# "Qwen3.8-27B"): width 5120, 64 layers, 24 / 4 heads x 256, SwiGLU 17408, vocabulary 248,320,
# rope 1e7, untied head, no output multiplier or soft cap.
QWEN3_8_27B = dict(vocab_size=248320, d_model=5120, n_layers=64, n_heads=24, n_kv_heads=4,
                   head_dim=256, d_ff=17408, rope_theta=1e7, norm_eps=1e-6, qk_norm=True,
                   tie_embeddings=False)


def get_config() -> Config:
  return Config(
      # RECIPE line 13 `dtype: bf16` (bf16 weights and AdamW moments, as the Muse config says
      # why); RECIPE line 36 `activation_checkpointing: false`: no remat.
      model=ModelConfig(**QWEN3_8_27B, param_dtype="bfloat16", compute_dtype="bfloat16",
                        remat="none", attention_chunk=512, logits_chunk=1024),
      drafter=DrafterConfig(
          target="",  # the verifier's Hugging Face folder, for its embedding and LM head
          # ASSUMED: 5 layers of the verifier's width and heads, its d_ff (the Muse drafter's
          # shape: 5 layers, the verifier's heads and MLP width).
          n_layers=5,
          # RECIPE line 11 `target_layer_ids: [6, 20, 34, 48, 62]`, the seed's canonical ids
          # (Hugging Face's hidden_states[i]; dflash/model.py ~274-285): the outputs of layers
          # 5, 19, 33, 47, 61, 0-based as `drafter.target_layers` names them.
          target_layers="5,19,33,47,61",
          # RECIPE lines 30-31: `target_features: offline`, `target_feature_path`.
          features="/data/dflash-features",
          # ASSUMED as the Muse drafter: 2 taps, groups of 16, every layer sliding with
          # W = 2048 (the seed's ~18.4K kept rows of 1M are 2048 anchors x stride 8 + W).
          conv_taps=2, conv_group_size=16, window=2048,
          # ASSUMED: the seed's default, causal draft blocks on sliding layers
          # (core/models/backbones/dflash/model.py ~1233-1254).
          sliding_causal=True,
          # Context pruning: 2048 locality anchors 8 apart (9 where 8 is not coprime with
          # their count) reach 2047 x 8 + 2047 = 18,423 rows (20,470), up to ~22,500 where
          # the run wraps to the sequence's start (both zigzag ends are rank 0's): 44 chunks.
          kept_context_rows=22528),
      data=DataConfig(seq_len=1 << 20),  # RECIPE line 12 `seq_len: 1048576`
      objective=ObjectiveConfig(
          name="dflash",  # RECIPE line 15 `dflash_distillation`
          block_size=8,  # RECIPE line 16
          max_anchors=2048,  # RECIPE line 17
          anchors="locality",  # RECIPE line 18
          dflash_loss="dpace",  # RECIPE line 20
          gamma=7.0,  # RECIPE line 21 `decay_gamma`
          dpace_alpha=0.5,  # RECIPE line 22
          lk_loss="lambda", kl_scale=1.0, kl_decay=1.0,  # RECIPE lines 23-25
          selector_loss_alpha=1.0,  # RECIPE line 26
          selector_rank=256, selector_top_k=16,  # ASSUMED as the Muse drafter
          # ASSUMED: the padded vocabulary's last row, which no token uses (a published
          # drafter declares its own; `drafter.init_from` takes it).
          mask_token_id=248319),
      # RECIPE line 1: 8 GPUs; lines 38-39: CP 2, BP 2 on one axis of max(CP, BP) = 2 ranks,
      # the other factor 4 data-parallel.
      parallel=ParallelConfig(strategy="csbp_ring", seq=2, data=4),
      # RECIPE lines 33-35, 41-43: batch 1 a data-parallel rank (4 a step), no accumulation,
      # lr 1e-6, clip 1.0; the seed's defaults (training/run_spec.py ~157-176): Adam eps 1e-5,
      # weight decay 0.01 on every parameter, a constant schedule, betas (0.9, 0.999).
      # Checkpoints every 100 steps, the last 3 (RECIPE lines 46-47).
      train=TrainConfig(steps=1000, batch_size=4, grad_accum=1, lr=1e-6, warmup_steps=0,
                        min_lr_ratio=1.0, weight_decay=0.01, decay_vectors=True, b1=0.9,
                        b2=0.999, eps=1e-5, grad_clip=1.0, log_every=1, ckpt_every=100,
                        max_to_keep=3, eval_every=0),
      plan=PlanConfig(target="tpu:v5p:2x2x2"),  # 8 TPU v5p chips, 95.74 GiB each
      seed=2026,  # RECIPE line 4 (`launch.seed`)
  )
