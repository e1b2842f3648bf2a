"""DFlash2 drafter training, tiny (docs/dflash.md, "DFlash2"): configs/dflash_tiny.py's
one-layer drafter with DFlash2's parts on: block convolutions (2 taps), sliding-window draft
attention (W = 16), locality anchors, the D-PACE weights with the LK lambda loss, and the
candidate selector (rank 16 over the head's top 8). A 2-core CPU trains it in minutes.

  python run.py --config configs/dflash2_tiny.py --set objective.name=ar \
      --workdir runs/tiny_ar --set train.steps=1500          # a frozen target of ours
  python run.py --config configs/dflash2_tiny.py                # the drafter, for runs/tiny_ar
  python experiments/dflash_tau.py --config configs/dflash2_tiny.py   # tau, with and without
                                                                      # the selector

`--set parallel.strategy=csbp_ring --set parallel.seq=4` (or cp_ring, cp_allgather, bp,
csbp_allgather) splits each sequence over 4 simulated devices; every one gives the same loss.
"""

from bdlm_jax.config import (Config, DataConfig, DrafterConfig, EvalConfig, ModelConfig,
                             ObjectiveConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=True),
      drafter=DrafterConfig(target="runs/tiny_ar", n_layers=1, target_layers="0,1",
                            conv_taps=2, conv_group_size=16, window=16),
      data=DataConfig(seq_len=64),
      objective=ObjectiveConfig(name="dflash", block_size=4, max_anchors=8, gamma=4.0,
                                mask_token_id=259, anchors="locality", dflash_loss="dpace",
                                dpace_alpha=0.5, lk_loss="lambda", selector_rank=16,
                                selector_top_k=8),
      train=TrainConfig(steps=1500, batch_size=32, lr=3e-3, warmup_steps=30, log_every=50,
                        ckpt_every=500, eval_every=500),
      eval=EvalConfig(batches=4, prompts=64),
  )
