"""Qwen3.5-style hybrid, tiny (docs/gdn.md): a random 4-layer model, three Gated DeltaNet
layers then one gated full-attention layer (partial RoPE 0.25), trained with the Fast-dLLM v2
conversion objective on the embedded arithmetic, one document a row (`data.pack=false`). A
2-core CPU trains it in a couple of minutes. `--set data.pack=true` packs several documents a
row, each its own segment: attention stays inside it and the Gated DeltaNet state and conv
restart at its start, under every strategy (docs/gdn.md; the seed's continuous stream, where
both cross documents, is `--set data.segment_ids=false`).

  python run.py --config configs/qwen3_5_tiny.py
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=4 python run.py --config configs/qwen3_5_tiny.py \
      --set parallel.strategy=csbp_ring --set parallel.seq=4 --workdir runs/qwen3_5_tiny_csbp

The second splits each sequence over 4 simulated devices (8 blocks: one dual-end pair a
rank) and logs the same loss. Qwen3.5's zero-centred norms are our norms (docs/gdn.md).
"""

from bdlm_jax.config import Config, DataConfig, ModelConfig, ObjectiveConfig, TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=True, layer_pattern="gdn,gdn,gdn,global",
                        attention_gate=True, partial_rotary_factor=0.25,
                        gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=16, gdn_value_dim=16,
                        gdn_conv=4),
      # L = 64, B = 8: 8 blocks. Arithmetic documents are 24 to ~80 bytes: most fit a row,
      # a longer one continues in a row of its own.
      data=DataConfig(seq_len=64, pack=False),
      objective=ObjectiveConfig(name="fast_dllm_v2", block_size=8, mask_token_id=259),
      train=TrainConfig(steps=200, batch_size=4, lr=3e-3, warmup_steps=20, log_every=10,
                        ckpt_every=100),
  )
