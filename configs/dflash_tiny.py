"""DFlash drafter training, tiny (docs/dflash.md): a one-layer drafter learns to propose
blocks of 4 tokens for a frozen 2-layer target on the embedded arithmetic data; a 2-core CPU
trains it in a few minutes.

  python experiments/make_tiny_hf.py --out runs/tiny_hf       # a random target, or a trained one:
  python run.py --config configs/dflash_tiny.py --set objective.name=ar --workdir runs/tiny_ar \
      --set train.steps=1500
  python run.py --config configs/dflash_tiny.py --set objective.name=ar --workdir runs/tiny_ar \
      --set mode=export --set export.out_dir=runs/tiny_hf --set export.overwrite=true
  python run.py --config configs/dflash_tiny.py                # the drafter, for runs/tiny_hf
  python experiments/dflash_tau.py --config configs/dflash_tiny.py   # trained vs untrained tau

`--set parallel.strategy=csbp_ring --set parallel.seq=4` (or cp_ring, cp_allgather, bp,
csbp_allgather) splits each sequence over 4 simulated devices. `model.*` are the target's
shapes (experiments/make_tiny_hf.py's); `drafter.target` may also name a workdir of ours.
"""

from bdlm_jax.config import (Config, DataConfig, DrafterConfig, EvalConfig, ModelConfig,
                             ObjectiveConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=True),
      drafter=DrafterConfig(target="runs/tiny_hf", n_layers=1, target_layers="0,1"),
      data=DataConfig(seq_len=64),
      objective=ObjectiveConfig(name="dflash", block_size=4, max_anchors=8, gamma=4.0,
                                mask_token_id=259),
      train=TrainConfig(steps=1500, batch_size=32, lr=3e-3, warmup_steps=30, log_every=50,
                        ckpt_every=500, eval_every=500),
      eval=EvalConfig(batches=4, prompts=64),
  )
