"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

import jax
import optax

from bdlm_jax.config import TrainConfig
from bdlm_jax.models.transformer import is_stacked


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
      decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  # Norm scales and other vectors (per layer, for stacked layer weights) are not decayed.
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim - is_stacked(path) >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask),
  )
