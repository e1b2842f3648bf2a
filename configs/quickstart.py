"""The quickstart: the paper's pipeline in miniature on the embedded arithmetic data. A small
autoregressive model is pretrained, then converted into a block-diffusion model by Fast-dLLM
v2 (AR -> BDLM conversion); about 5 minutes on an idle 2-core CPU.

  python run.py --config configs/quickstart.py

Stage 1 (`pretrain.*`) trains `ar` into runs/quickstart/pretrain and exports it there in
Hugging Face format; stage 2 starts from it and trains fast_dllm_v2 (blocks of 4) into
runs/quickstart. `--resume` continues whichever stage was stopped. It ends by printing both
models' held-out figures (the converted one decoded block by block) next to chance, and one
sample. The same model trained as a BD3-LM from scratch: configs/quickstart_bd3lm.py.
"""

import os

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, replace


def get_config() -> Config:
  scratch = load_config(os.path.join(os.path.dirname(__file__), "quickstart_bd3lm.py"))
  return replace(
      scratch,
      # An `ar` step is a fraction of a conversion step's work, and the converted model keeps
      # most of what the AR model knows, so most of the budget goes to pretraining (900 + 300
      # steps left seed 1's converted model at 25.0%, 1500 + 250 at 36.5%; three seeds:
      # experiments/results/quickstart_seeds.md). Conversion at a third of the pretraining lr.
      pretrain=dict(objective="ar", steps=1500, lr=3e-3),
      objective=dict(name="fast_dllm_v2"),
      train=dict(steps=250, lr=1e-3, ckpt_every=125, eval_every=250),
  )
