"""Context-sharded block parallelism on 8 simulated CPU devices: a tiny BDLM, one sequence
split over the `seq` axis; a few dozen steps take a minute or two on a 2-core CPU.

  python run.py --config configs/tiny_csbp.py

Compare strategies on the same model and data with e.g. `--set parallel.strategy=cp_ring`
(any of cp_ring, cp_allgather, bp, csbp_allgather; `none` also needs `--set parallel.seq=1`).
"""

from bdlm_jax.config import (Config, DataConfig, ModelConfig, ObjectiveConfig, ParallelConfig,
                             TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192),
      # L = 128, B = 8: 16 blocks = 2 per rank, one dual-end pair each.
      data=DataConfig(source="arithmetic", seq_len=128),
      objective=ObjectiveConfig(name="bd3lm", block_size=8, mask_token_id=259),
      parallel=ParallelConfig(strategy="csbp_ring", seq=8),
      train=TrainConfig(steps=100, batch_size=8, lr=3e-3, warmup_steps=10, log_every=10,
                        ckpt_every=50),
  )
