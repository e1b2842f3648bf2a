"""DiffusionGemma 26B-A4B SFT at 524,288 tokens on 16 TPU v5p chips: the 256K recipe
(configs/diffusiongemma_26b_a4b_sft_256k.py: the seed's settings, one conversation a row,
every token routed) at twice the seed's length, past the paper's.

  python run.py --config configs/diffusiongemma_26b_a4b_sft_512k.py --set mode=plan
  python experiments/recipe_plans.py --config configs/diffusiongemma_26b_a4b_sft_512k.py \
      --strategies csbp_ring --timeout 3600

A rank holds 2 x 32,768 rows (a canvas stream and the encoder's). What changes from 256K:
`model.row_chunks=32`, so that each chunk of the dropless dispatch keeps 256K's 2,048 rows
(its receive buffers hold every (token, expert) pair of a chunk of the 16 devices' rows:
1.48 GB, not twice that).
"""

import os

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace


def get_config() -> Config:
  recipe = load_config(os.path.join(os.path.dirname(__file__),
                                    "diffusiongemma_26b_a4b_sft_256k.py"))
  return replace(recipe, model=dict(row_chunks=32), data=dict(seq_len=1 << 19))
