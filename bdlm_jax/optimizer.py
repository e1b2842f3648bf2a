"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

import jax
import jax.numpy as jnp
import optax

from bdlm_jax.config import TrainConfig
from bdlm_jax.models.transformer import is_stacked


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
  """`train.schedule`: "cosine" warms up from 0 and ends the cosine at the last step;
  "seed_cosine" is the seed's (Turbo-dLLM 0.1.6, `training/optimizer_setup.py` ~149-178):
  update n (from 1) warms up linearly from the floor, then a cosine over `train.steps`
  steps *after* the warm-up, so a run ends above the floor."""
  floor = cfg.lr * cfg.min_lr_ratio
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
        decay_steps=cfg.steps, end_value=floor)

  def seed_cosine(count):
    n = count + 1  # the seed numbers updates from 1
    warm = floor + (cfg.lr - floor) * n / max(cfg.warmup_steps, 1)
    progress = jnp.clip(n - cfg.warmup_steps, 0, cfg.steps) / cfg.steps
    cosine = floor + (cfg.lr - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(n <= cfg.warmup_steps, warm, cosine)
  return seed_cosine


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  # Norm scales and other vectors (per layer, for stacked layer weights) are not decayed,
  # unless train.decay_vectors (the seed's single parameter group).
  decay_mask = None if cfg.decay_vectors else lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim - is_stacked(path) >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=decay_mask),
  )
