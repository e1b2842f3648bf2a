"""Training objectives, each a module with one protocol, so `loss_fn` runs any of them as
rows -> corrupt -> model -> score, with no branch per objective:

  LOSS_SLOT                                  "noisy", "clean" or "all": the rows of each rank
                                             whose logits are scored
  NOISY_STREAM                               whether the rows are [x_t ; x_0] (block
                                             diffusion) or the clean tokens alone (ar)
  COPIES                                     sequences `corrupt` runs per batch sequence
  TOKEN_SHIFT                                whether row i's logits predict token i + 1 of a
                                             block (what the sampler reads)
  DRAFTER                                    whether the model is a drafter over a frozen
                                             target (dflash): the noisy stream is its draft
                                             blocks, the clean stream the target's context
  evaluated(cfg, t_min) -> dict              the objective.* overrides under which held-out
                                             eval scores it (bd3lm: the NELBO)
  logical_rows(tokens_SL, seg_SL, protected_SL, cfg) -> dict
                                             host side: the logical [S, 2L] rows (labels,
                                             maskable, ...) that `make_batch` lays out
  corrupt(key, batch, seq_len, cfg) -> (batch, inputs, scored, weight)
                                             in the step: the batch the model runs (an
                                             objective may add copies of its sequences), the
                                             input token of each row, which rows are scored
                                             and their weights
  score(logits, labels, scored, weight, cfg) -> float
                                             the summed loss of one chunk of rows (a drafter's
                                             also takes its target's logits at those rows,
                                             before cfg, for a KL loss)
"""

from bdlm_jax.config import ConfigError
from bdlm_jax.objectives import ar, bd3lm, dflash, fast_dllm_v2

_OBJECTIVES = {"bd3lm": bd3lm, "fast_dllm_v2": fast_dllm_v2, "ar": ar, "dflash": dflash}


def get_objective(name: str):
  if name not in _OBJECTIVES:
    raise ConfigError(f"unknown objective.name {name!r}; valid: {sorted(_OBJECTIVES)}")
  return _OBJECTIVES[name]
