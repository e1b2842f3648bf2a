"""A DFlash drafter (docs/dflash.md) beside its frozen target, with no parallelism inside.

The drafter is a few Qwen3-style layers over *draft rows* (blocks `[x_a, MASK ...]`). Its
context is the target's hidden states at a few layers, concatenated per position, projected
by `fc` and normed once; every drafter layer projects that same context with its own k/v
projections, so context rows are keys only and never pass through a layer. The target's
embedding and LM head are the drafter's too, and stay frozen with the rest of the target.

Attention is the caller's, `attend(q, k, v, q_meta, k_meta, k_ctx, v_ctx, ctx_meta)`: the
draft rows' queries against their own keys and the context's, given apart.
"""

import jax
import numpy as np
from flax import nnx

from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.models.transformer import (AttendFn, LayerStack, RMSNorm, RowsFn, Transformer,
                                         _linear, in_parts)

FROZEN = "target"  # the params subtree that gets no gradient and no optimiser state
TRAINED = "drafter"  # the params subtree that trains


def target_layer_ids(cfg: Config) -> tuple[int, ...]:
  """The target layers whose outputs feed the drafter: `drafter.target_layers`, or up to
  `drafter.n_layers` distinct ids spread from layer 1 to layer n-3 of the target (DFlash's
  choice: neither the first layer nor the last two), clipped to the target's depth."""
  text = cfg.drafter.target_layers.strip()
  if text:
    try:
      return tuple(int(t) for t in text.split(","))
    except ValueError:
      raise ConfigError(f"drafter.target_layers={text!r} must be comma-separated integers")
  n = cfg.model.n_layers
  lo, hi = min(1, n - 1), max(min(1, n - 1), n - 3)
  return tuple(int(i) for i in np.unique(np.round(np.linspace(lo, hi, cfg.drafter.n_layers))))


def target_depth(cfg: Config) -> int:
  """Target layers a drafter's step runs: up to its last chosen layer, all of them for a KL
  loss (which reads the target's output), none with precomputed features."""
  if cfg.drafter.features:
    return 0
  if cfg.objective.draft_loss == "kl":
    return cfg.model.n_layers
  return max(target_layer_ids(cfg)) + 1


def drafter_model(cfg: Config) -> ModelConfig:
  """The drafter's layers as a ModelConfig: Qwen3-style (q/k norm, SwiGLU, global attention),
  the target's width, dtypes and attention settings, `drafter.*` for the rest."""
  m, d = cfg.model, cfg.drafter
  return ModelConfig(
      vocab_size=m.vocab_size, d_model=m.d_model, n_layers=d.n_layers,
      n_heads=d.n_heads or m.n_heads, n_kv_heads=d.n_kv_heads or m.n_kv_heads,
      head_dim=d.head_dim or m.head_dim, d_ff=d.d_ff or m.d_ff, rope_theta=m.rope_theta,
      qk_norm=True, norm_eps=m.norm_eps, param_dtype=m.param_dtype,
      compute_dtype=m.compute_dtype, remat=m.remat, attention_impl=m.attention_impl,
      attention_chunk=m.attention_chunk, logits_chunk=m.logits_chunk, row_chunks=m.row_chunks)


class Drafter(LayerStack):
  def __init__(self, cfg: ModelConfig, n_features: int, rngs: nnx.Rngs):
    self.cfg = cfg
    self.fc = _linear(n_features * cfg.d_model, cfg.d_model, cfg, rngs)
    self.hidden_norm = RMSNorm(cfg.d_model, cfg.norm_eps, jax.numpy.dtype(cfg.param_dtype))
    self.build_layers(cfg, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, jax.numpy.dtype(cfg.param_dtype))

  def __call__(self, x_BQD, pos_BQ, meta: RowMeta, feats_BCKD, ctx_pos_BC, ctx_meta: RowMeta,
               attend: AttendFn, layer_weights=None, rows: RowsFn = in_parts) -> jax.Array:
    """Final hidden states [B, Q, D] of the draft rows, from their embedded inputs `x_BQD`
    and the target's features [B, C, K, D] at the context rows."""
    b, c = feats_BCKD.shape[:2]
    ctx_BCD = self.hidden_norm(self.fc(feats_BCKD.reshape(b, c, -1)))

    def layer(block, carry, kind):
      # The context and the metadata ride in the carry, unchanged (see Transformer.forward).
      x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, meta, ctx_meta = carry
      q, k, v = block.project(x_BQD, pos_BQ, kind, rows)
      k_ctx, v_ctx = block.attn.kv(ctx_BCD, ctx_pos_BC, kind)
      out_BQHD, _ = attend(q, k, v, meta, meta, k_ctx, v_ctx, ctx_meta)
      x_BQD, _ = block.finish(x_BQD, out_BQHD, rows=rows)
      return (x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, meta, ctx_meta), None

    carry = (x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, meta, ctx_meta)
    (x_BQD, *_), _ = self.scan_layers(layer, carry, remat=self.cfg.remat,
                                      layer_weights=layer_weights)
    return self.final_norm(x_BQD)


class DFlash(nnx.Module):
  """The frozen target (a `Transformer`, params `target`) and its drafter (`drafter`)."""

  def __init__(self, target: ModelConfig, drafter: ModelConfig, n_features: int,
               rngs: nnx.Rngs):
    self.target = Transformer(target, rngs)  # params[FROZEN]
    self.drafter = Drafter(drafter, n_features, rngs)  # params[TRAINED]

  @property
  def head(self) -> nnx.Module:
    """The drafter's logits are the target's LM head's."""
    return self.target.head
