"""A mixture-of-experts MLP in the Qwen3-MoE form, with no parallelism inside.

A linear router scores E experts per token; the float32 softmax over all of them gives the
top-k experts and their weights (renormalised to sum to 1 when `model.moe_norm_topk`). The
(token, expert) pairs are sorted by expert and each expert's SwiGLU runs on its own rows as a
grouped matmul (`jax.lax.ragged_dot`), never on all E x tokens. Each call also returns the
router statistics that the load-balancing and z losses need, summed over the rows that count.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig

ACTIVATIONS = {  # model.mlp_activation of the gated MLPs, dense or expert
    "silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def _experts_init(shape, param_dtype, rngs):
  init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                           out_axis=-1, batch_axis=(0,))
  return nnx.Param(init(rngs.params(), shape, param_dtype))


class MoE(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, d, f = cfg.moe_experts, cfg.d_model, cfg.moe_d_ff or cfg.d_ff
    param_dtype = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.dtype(cfg.compute_dtype),
                             param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = _experts_init((e, d, f), param_dtype, rngs)  # kernel_EDF
    self.up_proj = _experts_init((e, d, f), param_dtype, rngs)
    self.down_proj = _experts_init((e, f, d), param_dtype, rngs)  # kernel_EFD

  def __call__(self, x_BRD, row_weight_BR=None, dispatch=None):
    """(out [B, R, D], router stats) of `experts`, run by `dispatch(fn, x, row_weight,
    weights)` (the caller's hook to run it where the rows live; default: here)."""
    weights = (self.router.kernel[...], self.gate_proj[...], self.up_proj[...],
               self.down_proj[...])
    if row_weight_BR is None:
      row_weight_BR = jnp.ones(x_BRD.shape[:2], jnp.float32)
    fn = functools.partial(experts, self.cfg)
    return (dispatch or (lambda fn, *args: fn(*args)))(fn, x_BRD, row_weight_BR, weights)


def experts(cfg: ModelConfig, x_BRD, row_weight_BR, weights):
  """(out [B, R, D], router stats) of the rows at hand, with no communication.

  The stats are float32 sums over the rows weighted by `row_weight_BR`: tokens [], picks [E]
  (how often each expert is in a row's top-k), probs [E] (router probabilities), z []
  (squared log-sum-exp of the logits); sums, so that shards of rows add up.
  """
  router_DE, gate_EDF, up_EDF, down_EFD = weights
  b, r, d = x_BRD.shape
  e, k = cfg.moe_experts, cfg.moe_top_k
  dtype = x_BRD.dtype
  x_TD = x_BRD.reshape(b * r, d)
  logits_TE = (x_TD @ router_DE.astype(dtype)).astype(jnp.float32)
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  weight_TK, expert_TK = jax.lax.top_k(probs_TE, k)
  if cfg.moe_norm_topk:
    weight_TK = weight_TK / weight_TK.sum(-1, keepdims=True)

  # Pairs sorted by expert: expert j's rows are the j-th group of the grouped matmuls.
  expert_P = expert_TK.reshape(-1)
  order_P = jnp.argsort(expert_P, stable=True)
  x_PD = x_TD[order_P // k]
  sizes_E = jnp.bincount(expert_P, length=e).astype(jnp.int32)
  mm = lambda a, w: jax.lax.ragged_dot(a, w.astype(dtype), sizes_E)
  h_PF = ACTIVATIONS[cfg.mlp_activation](mm(x_PD, gate_EDF)) * mm(x_PD, up_EDF)
  y_PD = mm(h_PF, down_EFD)
  y_TKD = jnp.zeros_like(y_PD).at[order_P].set(y_PD).reshape(b * r, k, d)
  out_TD = jnp.einsum("tkd,tk->td", y_TKD, weight_TK.astype(dtype))

  w_T1 = row_weight_BR.reshape(-1, 1).astype(jnp.float32)
  stats = dict(tokens=w_T1.sum(), picks=jnp.zeros(e).at[expert_TK].add(w_T1),
               probs=(w_T1 * probs_TE).sum(0),
               z=(w_T1[:, 0] * jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))).sum())
  return out_TD.reshape(b, r, d), stats


def router_losses(stats: dict, num_experts: int) -> dict:
  """Load-balancing loss and z-loss from per-layer `MoE` stats stacked on a layer axis.

  As Qwen3-MoE's `load_balancing_loss_func`: E * sum_e f_e * P_e, with f (share of top-k
  picks) and P (mean probability) pooled over every layer's counted tokens, and the expert
  load max_e f_e / mean_e f_e (1 = balanced).
  """
  tokens = jnp.maximum(stats["tokens"].sum(), 1.0)
  f_E = stats["picks"].sum(0) / tokens
  p_E = stats["probs"].sum(0) / tokens
  return dict(moe_aux_loss=num_experts * jnp.sum(f_E * p_E),
              moe_z_loss=stats["z"].sum() / tokens,
              moe_max_load=f_E.max() / jnp.maximum(f_E.mean(), 1e-9))
