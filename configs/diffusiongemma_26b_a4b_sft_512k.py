"""DiffusionGemma 26B-A4B SFT at 524,288 tokens on 16 TPU v5p chips: the 256K recipe
(configs/diffusiongemma_26b_a4b_sft_256k.py: the seed's settings, one conversation a row,
every token routed) at twice the seed's length, past the paper's.

  python run.py --config configs/diffusiongemma_26b_a4b_sft_512k.py --set mode=plan
  python experiments/recipe_plans.py --config configs/diffusiongemma_26b_a4b_sft_512k.py \
      --strategies csbp_ring --timeout 3600

A rank holds 2 x 32,768 rows (a canvas stream and the encoder's). What changes from 256K is
the length alone. `model.row_chunks=32` is set here as well, since this length needs it:
routed in 16 chunks XLA:TPU refuses the step for HBM (101.85G of temporaries). Each of the
32 chunks of the dropless dispatch holds 2,048 of a rank's rows, twice 256K's, so its
receive buffers hold every (token, expert) pair of a chunk of the 16 devices' rows: 1.48 GB.
"""

import os

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace


def get_config() -> Config:
  recipe = load_config(os.path.join(os.path.dirname(__file__),
                                    "diffusiongemma_26b_a4b_sft_256k.py"))
  return replace(recipe, model=dict(row_chunks=32), data=dict(seq_len=1 << 19))
