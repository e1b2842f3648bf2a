"""DiffusionGemma 26B-A4B, the seed paper's SFT recipe: one 262,144-token chat sequence a step
on 16 devices, context-sharded block parallelism (csbp_ring), the 128 experts split over the
16 devices, the diffusiongemma objective (canvases of 256 uniform-token-corrupted tokens,
self-conditioning on half the sequences, the encoder's next-token loss).

  python run.py --config configs/diffusiongemma_26b_a4b_sft_256k.py --set mode=plan
  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models diffusiongemma-26b-a4b \
      --objective diffusiongemma --lens 262144 --strategies csbp_ring cp_ring \
      --remat offload --set model.row_chunks=16

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 16 TPU v5p chips
(`plan.target`; `pip install -r requirements-tpu.txt`, no TPU); `--set plan.target=cpu`
compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES=16; XLA:CPU has no ragged all-to-all,
so add `--set parallel.moe_dispatch=all_gather` there). docs/train_diffusiongemma.md
holds the plan table.

Dropless, csbp_ring compiled with XLA:TPU for 16 v5p reads a peak of 81.87 GB a device (bound
101.62 GB; the all-gather dispatch 80.18 GB) against 95.74 GiB = 102.8 GB, where the same
step dropping at 1.25x capacity read 90.63 GB:

  python experiments/scale_probe.py --target tpu:v5p:2x2x4 --models diffusiongemma-26b-a4b \
      --objective diffusiongemma --lens 262144 --strategies csbp_ring --block-size 256 \
      --remat offload --set model.row_chunks=16 model.attention_chunk=512 \
      model.logits_chunk=1024 model.moe_drop_tokens=false --dispatch real --depth-check 0

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
      # dispatch routes each device's rows in the 16 row chunks, so a device's static receive
      # buffer holds every pair of one chunk of the 16 devices' rows (16 x 16,384 pairs, 1.5
      # GB), not of all of them (24 GB, per layer; XLA:TPU refused that step at 333.98 GB of
      # temporaries).
      model=ModelConfig(**DIFFUSIONGEMMA_26B_A4B, param_dtype="float32",
                        compute_dtype="bfloat16", remat="offload", row_chunks=16,
                        attention_chunk=512, logits_chunk=1024, moe_drop_tokens=False),
      data=DataConfig(source="arithmetic", format="chat", seq_len=1 << 18),
      objective=ObjectiveConfig(name="diffusiongemma", block_size=256, loss_weight="unit",
                                self_condition_p=0.5, encoder_loss_weight=1.0),
      parallel=ParallelConfig(strategy="csbp_ring", seq=16, expert_axes="seq"),
      train=TrainConfig(steps=1000, batch_size=1, lr=1e-5, warmup_steps=50, log_every=1,
                        ckpt_every=100),
      plan=PlanConfig(target="tpu:v5p:2x2x4"),
      # init_from="/path/to/diffusiongemma-26B-A4B-it",
  )
