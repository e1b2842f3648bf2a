"""DiffusionGemma 26B-A4B SFT: the seed's recipe (Turbo-dLLM 0.1.6,
`dllm_parallel/recipes/runs/diffusiongemma-26b-sft-256k.yaml`) on 16 TPU v5p chips. As the
recipe: one conversation a row (`data.pack=false`, as the seed trains), one row of up to
262,144 tokens a step, 1000 steps; the diffusiongemma objective with its settings (canvases
of 256, t antithetic over the response canvases in [0.001, 1], uniform-token corruption
with probability t, unit weights, self-conditioning on half the conversations, the
encoder's next-token loss with weight 1.0, routers frozen, every token routed); AdamW with
lr 1e-5, betas 0.95 / 0.99, eps 1e-8, weight decay 1e-4 on every parameter (the seed's one
parameter group: `train.decay_vectors`), global-norm clip 1.0, and the seed's schedule
(`train.schedule=seed_cosine`: 40 warm-up steps from 1e-6, then a cosine toward 1e-6,
`min_lr_ratio` 0.1, over the 1000 steps after them); a checkpoint every 100 steps, the last
3 kept.
Ours, not the recipe's: the sharding, context-sharded block parallelism (csbp_ring) over
the 16 devices with the 128 experts split over them (the differences are listed below).

  python run.py --config configs/diffusiongemma_26b_a4b_sft_256k.py --set mode=plan
  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models diffusiongemma-26b-a4b \
      --objective diffusiongemma --lens 262144 --strategies csbp_ring cp_ring \
      --remat offload --set model.row_chunks=32

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; `pip install -r requirements-tpu.txt`, no TPU); `--set plan.target=cpu`
compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES=16; XLA:CPU has no ragged all-to-all,
so add `--set parallel.moe_dispatch=all_gather` there). docs/train_diffusiongemma.md
holds the plan table.

Compiled as it ships for 16 v5p, per device (what the device allocates, what is live at its
peak, the compiler's peak, the bound, host bytes), by

  python experiments/recipe_plans.py --config configs/diffusiongemma_26b_a4b_sft_256k.py \
      --strategies csbp_ring --timeout 3000

into experiments/results/recipe_plans.md (docs/train_diffusiongemma.md quotes it).

Where this differs from the seed's recipe (files of the seed's package `dllm_parallel`):

* Hardware and memory: the seed runs 2 nodes x 8 H200 (CP 8 x BP 8, EP 2), DeepSpeed ZeRO-2
  and full activation checkpointing (the yaml's `topology`, `optimizer.backend`,
  `training.activation_checkpointing*`); here 16 TPU v5p, csbp_ring, the experts over all
  16 devices, remat offload with 32 row chunks. The loss is the same.
* Precision: the seed holds the model in bf16 (the yaml's `model.dtype`; DeepSpeed's bf16
  mode updates float32 master copies); here float32 parameters and optimiser state,
  bfloat16 compute.
* Encoder pairs (core/models/backbones/nemotron/model.py:1966-2030,
  `_native_encoder_ar_loss`; core/objectives/training.py:471, the pair count): the seed
  counts every next-token pair of the conversation; ours leaves out those whose first token
  lies in the row's last canvas (docs/diffusiongemma.md), so only a conversation reaching
  the row's last 256 positions loses any (at most 255 of 262,143).
* Row layout (core/objectives/diffusiongemma.py:210-250; core/data.py:613-616, 715;
  data/packing.py:64-71): the seed's row is one conversation of exactly its own length,
  which preparation makes a multiple of 256 (`packing.alignment_policy`, default
  `truncate_right`: data/schemas.py:87, cutting up to 255 of its last tokens), its canvases
  starting at the response; a batch of several rows must share one response start and
  length. Ours pads the prompt on the left to a multiple of 256 (so the response starts a
  canvas, as the seed's), the response on the right and the row to 262,144, with padding
  that no token sees: the same canvases, draws and loss (tests/objectives/
  test_seed_diffusiongemma.py), no token cut, no shared-start rule, and a short
  conversation still computes a full-length row.
* Data and draws: the seed reads its prepared dataset (`data.dataset_path`, shuffled with
  seed 2026) and draws with torch's generator; here the embedded arithmetic until `data`
  points at chat JSONL, and jax's keys.

Random weights and the embedded arithmetic conversations, so it compiles and runs from a fresh
clone; for the real model, uncomment `init_from` (the Hugging Face folder: `import_hf` reads
its text model) and point `data` at chat JSONL (`data.source=jsonl`, `data.path=...`).
"""

from bdlm_jax.config import (Config, DataConfig, ModelConfig, ObjectiveConfig, ParallelConfig,
                             PlanConfig, TrainConfig)

# google/diffusiongemma-26B-A4B-it config.json (text_config; the Gemma 4 26B-A4B text model's
# dimensions): 30 layers, 5 sliding (window 1024) : 1 full; full layers with head dim 512, two
# K/V heads, K = V and proportional RoPE on a quarter of the frequencies (base 1e6); sliding
# layers with head dim 256, eight K/V heads, RoPE base 1e4; 128 experts of width 704, 8 a token,
# beside a dense MLP of width 2112; vocabulary 262,144, logit soft cap 30; canvas_length 256.
# (experiments/scale_probe.py reads this dict for its diffusiongemma-26b-a4b preset.)
DIFFUSIONGEMMA_26B_A4B = dict(
    vocab_size=262144, d_model=2816, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256,
    d_ff=2112, norm_eps=1e-6, qk_norm=True, v_norm=True, post_norms=True,
    scale_embeddings=True, layer_scalar=True, query_pre_attn_scalar=1,
    mlp_activation="gelu_tanh", layer_pattern="local,local,local,local,local,global",
    sliding_window=1024, rope_theta=1e6, rope_local_theta=1e4,
    global_partial_rotary_factor=0.25, global_head_dim=512, global_n_kv_heads=2,
    attention_k_eq_v=True, logit_softcap=30.0, tie_embeddings=True, moe_experts=128,
    moe_top_k=8, moe_d_ff=704, moe_norm_topk=True, moe_beside_dense=True, moe_router_norm=True,
    moe_aux_weight=0.0, self_conditioning=True)


def get_config() -> Config:
  return Config(
      # Dropless, as transformers and the seed: every token goes to its top 8 experts. The
      # dispatch routes each device's rows in 32 row chunks, so a device's static receive
      # buffer holds every pair of one chunk of the 16 devices' rows (16 x 8,192 pairs, 0.74
      # GB), not of all of them (24 GB, per layer; XLA:TPU refused that step at 333.98 GB of
      # temporaries). 16 chunks compile too, at 16.8 GB more on the device for the same FLOPs
      # and collective bytes (docs/scale.md).
      model=ModelConfig(**DIFFUSIONGEMMA_26B_A4B, param_dtype="float32",
                        compute_dtype="bfloat16", remat="offload", row_chunks=32,
                        attention_chunk=512, logits_chunk=1024, moe_drop_tokens=False),
      # one conversation a row, as the seed's native SFT (data/chat.py `chat_per_row`)
      data=DataConfig(source="arithmetic", format="chat", seq_len=1 << 18, pack=False),
      objective=ObjectiveConfig(name="diffusiongemma", block_size=256, eps_min=1e-3,
                                eps_max=1.0, antithetic=True, loss_weight="unit",
                                self_condition_p=0.5, encoder_loss_weight=1.0),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16, expert_axes="seq"),
      # the recipe's optimizer and scheduler; decay_vectors: weight decay on every parameter
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-5, warmup_steps=40, min_lr_ratio=0.1,
                        schedule="seed_cosine", b1=0.95, b2=0.99, eps=1e-8, weight_decay=1e-4,
                        decay_vectors=True, grad_clip=1.0, log_every=1, ckpt_every=100,
                        max_to_keep=3),
      seed=2026,  # the recipe's launch seed
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/diffusiongemma-26B-A4B-it",
  )
