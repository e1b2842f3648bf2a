"""DiffusionGemma SFT, tiny: random Gemma 4 layers trained with the diffusiongemma objective on
the embedded arithmetic as chat ("User: 12+7=\nAssistant: " -> "19<eos>"); a 2-core CPU runs
it in about 4 minutes.

  python run.py --config configs/diffusiongemma_tiny.py
  python run.py --config configs/diffusiongemma_tiny.py --set train.steps=1 \
      --set train.eval_every=0 --set parallel.strategy=csbp_ring --set parallel.seq=4

Measured on a shared 2-core CPU (2026-12-05, 3 min 56 s wall, ~2,200 tokens/s): the held-out
loss (decoder plus encoder loss, nats per token) at steps 75, 150, 225, 300 is 1.586, 1.364,
1.282, 1.256 (training loss 10.50 at step 10, 1.23 at step 300). The model has learnt the
answers' form (digits, then EOS) but not yet arithmetic: accuracy 0.0% (chance 0.0%).
Blocks of 4 hold every answer and its EOS in one canvas; blocks of 8 reached 1.210 on their
own held-out batches, but their samples ran past the answer without an EOS.

Step 1 through run.py (second command above, 4 simulated devices) gives loss 10.973748,
as `parallel.strategy=none` does (10.973749; relative difference 9e-8).
"""

from bdlm_jax.config import (Config, DataConfig, EvalConfig, ModelConfig, ObjectiveConfig,
                             TrainConfig)


def get_config() -> Config:
  return Config(
      # Gemma 4's layers at toy size: local layers (window 16) and global ones with their own
      # head dim, one K/V head with K = V and a quarter of RoPE's frequencies, the last layer
      # forced global; 4 experts (top 2) beside each dense MLP; the self-conditioning module.
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128, layer_pattern="local,local,global",
                        last_layer_global=True, sliding_window=16, rope_theta=1e6,
                        rope_local_theta=1e4, global_head_dim=32, global_n_kv_heads=1,
                        attention_k_eq_v=True, global_partial_rotary_factor=0.25, v_norm=True,
                        qk_norm=True, post_norms=True, scale_embeddings=True,
                        query_pre_attn_scalar=1, mlp_activation="gelu_tanh",
                        logit_softcap=30.0, layer_scalar=True, moe_experts=4, moe_top_k=2,
                        moe_d_ff=64, moe_norm_topk=True, moe_beside_dense=True,
                        moe_router_norm=True, moe_aux_weight=0.01, self_conditioning=True),
      data=DataConfig(source="arithmetic", format="chat", seq_len=64),
      objective=ObjectiveConfig(name="diffusiongemma", block_size=4, loss_weight="unit",
                                self_condition_p=0.5, encoder_loss_weight=1.0),
      train=TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=20, log_every=10,
                        ckpt_every=100, eval_every=75),
      eval=EvalConfig(prompts=64),
  )
