"""A mixture-of-experts MLP in the Qwen3-MoE form, with no parallelism inside.

A linear router scores E experts per token; the float32 softmax over all of them gives the
top-k experts and their weights (renormalised to sum to 1 when `model.moe_norm_topk`). The
(token, expert) pairs are sorted by expert and each expert's SwiGLU runs on its own rows as a
grouped matmul (`jax.lax.ragged_dot`), never on all E x tokens. Each call also returns the
router statistics that the load-balancing and z losses need, summed over the rows that count.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig


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

  def __call__(self, x_BRD, row_weight_BR=None):
    """(out [B, R, D], router stats): the stats are float32 sums over the rows weighted by
    `row_weight_BR` (default all): tokens [], picks [E] (how often each expert is in a row's
    top-k), probs [E] (router probabilities), z [] (squared log-sum-exp of the logits)."""
    cfg = self.cfg
    b, r, d = x_BRD.shape
    e, k = cfg.moe_experts, cfg.moe_top_k
    x_TD = x_BRD.reshape(b * r, d)
    logits_TE = self.router(x_TD).astype(jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weight_TK, expert_TK = jax.lax.top_k(probs_TE, k)
    if cfg.moe_norm_topk:
      weight_TK = weight_TK / weight_TK.sum(-1, keepdims=True)

    # Pairs sorted by expert: expert j's rows are the j-th group of the grouped matmuls.
    expert_P = expert_TK.reshape(-1)
    order_P = jnp.argsort(expert_P, stable=True)
    x_PD = x_TD[order_P // k]
    sizes_E = jnp.bincount(expert_P, length=e).astype(jnp.int32)
    dtype = x_BRD.dtype
    mm = lambda a, w: jax.lax.ragged_dot(a, w[...].astype(dtype), sizes_E)
    h_PF = jax.nn.silu(mm(x_PD, self.gate_proj)) * mm(x_PD, self.up_proj)
    y_PD = mm(h_PF, self.down_proj)
    y_TKD = jnp.zeros_like(y_PD).at[order_P].set(y_PD).reshape(b * r, k, d)
    out_TD = jnp.einsum("tkd,tk->td", y_TKD, weight_TK.astype(dtype))

    w_T = (jnp.ones((b * r,), jnp.float32) if row_weight_BR is None
           else row_weight_BR.reshape(-1).astype(jnp.float32))
    picks_TE = jax.nn.one_hot(expert_TK, e, dtype=jnp.float32).sum(1)
    stats = dict(tokens=w_T.sum(), picks=w_T @ picks_TE, probs=w_T @ probs_TE,
                 z=w_T @ jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
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
