"""A small BDLM on the embedded arithmetic data; trains on a 2-core CPU in a few minutes.

  python run.py --config configs/quickstart.py
"""

from bdlm_jax.config import Config, DataConfig, ModelConfig, ObjectiveConfig, TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=260, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=32, d_ff=384),
      data=DataConfig(source="arithmetic", seq_len=128),
      objective=ObjectiveConfig(name="bd3lm", block_size=16, mask_token_id=259),
      train=TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup_steps=20, log_every=10,
                        ckpt_every=100),
  )
