"""BD3-LM: antithetic block noise levels, [MASK] corruption, the SUBS loss (docs/objective.md)."""

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.kernels.mask import NOISY
from bdlm_jax.objectives.base import (check_block_size, count_labels, model_hidden,
                                     no_first_pass, no_step_counts)
from bdlm_jax.objectives.streams import logical_stream

NAME = "bd3lm"
LOSS_SLOT = "noisy"  # logits are computed only for the noisy rows
NOISY_STREAM = True
COPIES = 1
DRAFTER = False
SAMPLER = "mask"
BLOCK_IDS = "index"
TOKEN_SHIFT = False
MASK_TOKEN = True
FROZEN = ()
HELD_OUT = ("NELBO", "perplexity bound")  # eval scores the NELBO (`evaluated`)
FREEZE = ""
ATTEND_ROWS = ("all",)
hidden = model_hidden
normalizer = count_labels
first_passes = no_first_pass
step_counts = no_step_counts


def check_config(cfg: Config) -> None:
  check_block_size(cfg)


def evaluated(cfg: ObjectiveConfig, t_min: float) -> dict:
  """The NELBO: 1/t weights over noise levels [t_min, 1], whatever the training weights."""
  del cfg
  return dict(loss_weight="inv_t", eps_min=t_min, eps_max=1.0)


def nelbo_config(cfg: ObjectiveConfig, t_min: float) -> dict:
  """The objective.* overrides under which `nelbo_corrupt` draws the NELBO (likelihood.py):
  the held-out eval's."""
  return evaluated(cfg, t_min)


def logical_rows(tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig) -> dict:
  """Noisy rows are supervised (and maskable) unless protected or padding."""
  rows = logical_stream(tokens_SL, seg_SL)
  prot = np.concatenate([protected_SL, protected_SL], 1)
  maskable = (rows["stream"] == NOISY) & (rows["seg"] > 0) & ~prot
  rows.update(block=rows["pos"] // cfg.block_size, maskable=maskable,
              labels=np.where(maskable, rows["tokens"], -1).astype(np.int32))
  return rows


def sample_t(key, num_seqs: int, num_blocks: int, eps_min: float, eps_max: float,
             antithetic: bool = True):
  """Noise levels [S, N], clipped to [eps_min, eps_max]. Antithetic: one uniform u,
  t_i = (u + i/(S*N)) mod 1 (lower variance); else one independent uniform each."""
  n = num_seqs * num_blocks
  if antithetic:
    t = jnp.mod(jax.random.uniform(key, ()) + jnp.arange(n, dtype=jnp.float32) / n, 1.0)
  else:
    t = jax.random.uniform(key, (n,))
  return (t * (eps_max - eps_min) + eps_min).reshape(num_seqs, num_blocks)


def draw_noise(key, num_seqs: int, seq_len: int, cfg: ObjectiveConfig):
  """Logical noise tables: t [S, N] per (sequence, block), a uniform u [S, L] per position."""
  k_t, k_u = jax.random.split(key)
  t_SN = sample_t(k_t, num_seqs, seq_len // cfg.block_size, cfg.eps_min, cfg.eps_max,
                  cfg.antithetic)
  return t_SN, jax.random.uniform(k_u, (num_seqs, seq_len))


def corrupt(key, batch, cfg: Config, counts=None):
  """Masks rows in *logical* coordinates, so every layout sees the same corruption.

  t is drawn per (sequence, block) and a uniform per (sequence, position); each row reads
  its own values through its position and block. Returns (batch, inputs, masked, weight)
  per row; a masked row is scored with weight w(t).
  """
  del counts  # the loss is divided by `normalizer`
  o = cfg.objective
  t_SN, u_SL = draw_noise(key, batch.tokens.shape[0], cfg.data.seq_len, o)
  t_row = jnp.take_along_axis(t_SN, batch.block, axis=1)
  u_row = jnp.take_along_axis(u_SL, batch.pos, axis=1)
  masked = batch.maskable & (u_row < t_row)
  inputs = jnp.where(masked, o.mask_token_id, batch.tokens)
  weight = 1.0 / t_row if o.loss_weight == "inv_t" else jnp.ones_like(t_row)
  return batch, inputs, masked, weight


nelbo_corrupt = corrupt  # under `nelbo_config`: masked tokens weigh 1/t


def token_nll(logits_SNV, labels_SN):
  """-log p(label) per row [S, N]; rows without a label (-1) give a finite don't-care."""
  logp = jax.nn.log_softmax(logits_SNV, axis=-1)
  return -jnp.take_along_axis(logp, jnp.maximum(labels_SN, 0)[..., None], axis=-1)[..., 0]


def subs_loss(logits_SNV, labels_SN, masked_SN, weight_SN, mask_token_id: int | None):
  """Sum over masked rows of w(t) * CE with the [MASK] logit removed (SUBS), or kept where
  `mask_token_id` is None."""
  if mask_token_id is not None:
    logits_SNV = logits_SNV.at[..., mask_token_id].set(-jnp.inf)
  nll = token_nll(logits_SNV, labels_SN)
  take = masked_SN & (labels_SN >= 0)
  return jnp.sum(jnp.where(take, weight_SN * nll, 0.0))


def score(logits_SNV, labels_SN, scored_SN, weight_SN, cfg: ObjectiveConfig):
  removed = None if cfg.keep_mask_logit else cfg.mask_token_id
  return subs_loss(logits_SNV, labels_SN, scored_SN, weight_SN, removed)
