"""Llama-3.1-8B as a block diffusion LM on one 1,048,576-token sequence a step, 4 TPU v5p chips:
configs/llama3_8b_bdlm_1m.py on a quarter of its chips, so a pod trains four times as many
sequences side by side.

  python run.py --config configs/llama3_8b_bdlm_1m_4chips.py --set mode=plan
  python experiments/recipe_plans.py --config configs/llama3_8b_bdlm_1m_4chips.py \
      --strategies csbp_ring --timeout 3600

A chip holds 262,144 tokens, 2 x 262,144 rows. What changes from 16 chips, and why:
* `model.remat=offload_period`, `model.scan_period=2`: the 32 layer inputs alone would be
  32 x 524,288 rows x 4096 x 2 B = 137.4 GB in host memory, past the 128 GiB XLA:TPU allows a
  chip. The host keeps the input of every second layer (68.7 GB); the backward re-runs two
  layers' forward at a time, their inputs and attention outputs then on the device, and
  recomputes each layer's projections and MLP once more (docs/memory.md).
* `model.row_chunks=64`: each layer's row-wise work in chunks of 8,192 rows, as on 16 chips.
"""

import os

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace


def get_config() -> Config:
  recipe = load_config(os.path.join(os.path.dirname(__file__), "llama3_8b_bdlm_1m.py"))
  return replace(recipe, model=dict(remat="offload_period", scan_period=2, row_chunks=64),
                 parallel=dict(seq=4), plan=dict(target="tpu:v5p:2x2x1"))
