"""Plain autoregressive next-token loss on the clean stream (sanity and AR baselines)."""

import jax.numpy as jnp
import numpy as np

from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.objectives.bd3lm import token_nll
from bdlm_jax.objectives.base import count_labels, model_hidden, no_first_pass, no_step_counts
from bdlm_jax.objectives.streams import logical_stream

NAME = "ar"
LOSS_SLOT = "clean"
NOISY_STREAM = False
COPIES = 1
DRAFTER = False
SAMPLER = "ar"
BLOCK_IDS = "index"  # (blocks of one token)
TOKEN_SHIFT = False  # (the sampler decodes an ar model token by token)
MASK_TOKEN = False
FROZEN = ()
HELD_OUT = ("NLL", "perplexity")  # the exact next-token NLL, and its exp
FREEZE = ""
ATTEND_ROWS = ("all",)
hidden = model_hidden
normalizer = count_labels
first_passes = no_first_pass
step_counts = no_step_counts


def check_config(cfg: Config) -> None:
  del cfg  # blocks of one token: any length


def evaluated(cfg: ObjectiveConfig, t_min: float) -> dict:
  del cfg, t_min
  return {}


def logical_rows(tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig) -> dict:
  """Causal attention is block-causal with blocks of one token, so block = position.

  Row p predicts token p+1 when both lie in the same document and p+1 is not protected.
  """
  rows = logical_stream(tokens_SL, seg_SL)
  nxt = np.roll(tokens_SL, -1, axis=1)
  ok = (np.roll(seg_SL, -1, axis=1) == seg_SL) & (seg_SL > 0) & ~np.roll(protected_SL, -1, 1)
  ok[:, -1] = False
  clean_labels = np.where(ok, nxt, -1)
  s, l = tokens_SL.shape
  rows.update(block=rows["pos"].copy(), maskable=np.zeros((s, 2 * l), bool),
              labels=np.concatenate([np.full((s, l), -1), clean_labels], 1).astype(np.int32))
  return rows


def corrupt(key, batch, cfg: Config, counts=None):
  """Nothing is corrupted: every clean row with a label is scored, with weight 1."""
  del counts  # the loss is divided by `normalizer`
  del key, cfg
  scored = batch.labels >= 0
  return batch, batch.tokens, scored, jnp.ones(scored.shape)


def score(logits_SNV, labels_SN, scored_SN, weight_SN, cfg: ObjectiveConfig):
  """Summed next-token NLL of the scored rows."""
  del cfg
  return jnp.sum(jnp.where(scored_SN, weight_SN * token_nll(logits_SNV, labels_SN), 0.0))
