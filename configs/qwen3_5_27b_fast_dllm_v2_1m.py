"""Qwen3.5-27B's AR -> BDLM conversion at 1,048,576 tokens on 16 TPU v5p chips: the 256K
recipe (configs/qwen3_5_27b_fast_dllm_v2_256k.py, the seed's Fast-dLLM v2 settings and
optimiser) at four times the seed's length, past the paper's.

  python run.py --config configs/qwen3_5_27b_fast_dllm_v2_1m.py --set mode=plan
  python experiments/recipe_plans.py --config configs/qwen3_5_27b_fast_dllm_v2_1m.py \
      --strategies csbp_ring --timeout 3600

A rank holds 2 x 2 x 65,536 rows (the two complementary copies, each noisy and clean). What
changes from 256K, and why:
* `model.remat=offload_period`: `offload` would keep each layer's saved residuals in host
  memory, four times 256K's 56 GB, past the 128 GiB XLA:TPU allows a chip, and even the layer
  inputs alone (`offload_input`) are 64 layers x 262,144 rows x 5120 x 2 B = 171.8 GB there.
  The host keeps the input of each scan step, one period of the pattern (3 Gated DeltaNet
  layers and 1 attention layer): 43.0 GB. The backward re-runs a step's forward (its K/V ring
  and Gated DeltaNet chain included), its layers' inputs and attention output then on the
  device, and recomputes each layer's projections and MLP once more (docs/memory.md).
* `model.row_chunks=64`: each layer's row-wise work (MLP, projections, the dropless loss)
  in chunks of 2,048 rows, as 256K's 16 chunks were.
The 16 attention layers carry the length; the 48 Gated DeltaNet layers' cross-device state
(the chain's per-head state and conv tails) is the same at any L (docs/gdn.md).
"""

import os

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace


def get_config() -> Config:
  recipe = load_config(os.path.join(os.path.dirname(__file__),
                                    "qwen3_5_27b_fast_dllm_v2_256k.py"))
  return replace(recipe, model=dict(remat="offload_period", row_chunks=64),
                 data=dict(seq_len=1 << 20))
