"""A mixture-of-experts MLP in the Qwen3-MoE form, with no parallelism inside.

A linear router scores E experts per token; the float32 softmax over all of them gives the
top-k experts and their weights (renormalised to sum to 1 when `model.moe_norm_topk`). The
(token, expert) pairs are sorted by expert and each expert's SwiGLU runs on its own rows as a
grouped matmul (`jax.lax.ragged_dot`), never on all E x tokens (except, on XLA:TPU, the
experts' weight gradient, which XLA computes as one dense matmul of every expert against all
the rows: E x the work; docs/measuring.md). Each call also returns the
router statistics that the load-balancing and z losses need, summed over the rows that count.

With `model.moe_router_norm` (Gemma 4) the layer reads the un-normed residual: the router
sees it through a weightless RMSNorm times a learned scale and d_model ** -0.5, a learned
per-expert scale multiplies the k weights, and the experts read their own RMSNorm of it.

With `model.moe_drop_tokens` an expert takes at most C = ceil(capacity_factor * T * k / E) of
the pairs of the T tokens routed together, first come first served; a dropped pair adds
nothing to its token's output. The pieces are pure functions of arrays, so that
`parallel/experts.py` can run the same routing with the experts spread over devices.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig
from bdlm_jax.models.norm import rms_norm

ACTIVATIONS = {  # model.mlp_activation of the gated MLPs, dense or expert
    "silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # MoE's stacked [E, ...] params


def is_expert_weight(path) -> bool:
  """Whether a pytree path (params, optimiser state, or one layer's nnx state) ends at an
  expert weight: `mlp/gate_proj` etc. with no `kernel` below (a dense MLP's has one)."""
  names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return names[-2:-1] == ["mlp"] and names[-1] in EXPERT_WEIGHTS


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
    if cfg.moe_router_norm:
      self.router_scale = nnx.Param(jnp.ones((d,), param_dtype))
      self.expert_scale = nnx.Param(jnp.ones((e,), param_dtype))
      self.expert_norm = nnx.Param(jnp.ones((d,), param_dtype))  # the experts' input RMSNorm

  def __call__(self, x_BRD, row_weight_BR=None, dispatch=None):
    """(out [B, R, D], router stats) of `experts`, or of `dispatch(x, row_weight, weights)`,
    the caller's hook to run it where the rows and experts live."""
    router = self.router.kernel[...]
    if self.cfg.moe_router_norm:
      router = (router, self.router_scale[...], self.expert_scale[...], self.expert_norm[...])
    weights = (router, self.gate_proj[...], self.up_proj[...], self.down_proj[...])
    if row_weight_BR is None:
      row_weight_BR = jnp.ones(x_BRD.shape[:2], jnp.float32)
    return (dispatch or functools.partial(experts, self.cfg))(x_BRD, row_weight_BR, weights)


def experts(cfg: ModelConfig, x_BRD, row_weight_BR, weights):
  """(out [B, R, D], router stats) of the rows at hand, with no communication.

  The stats are float32 sums over the rows weighted by `row_weight_BR`: tokens [], picks [E]
  (how often each expert is in a row's top-k), probs [E] (router probabilities), z []
  (squared log-sum-exp of the logits), dropped [] (picks over capacity); sums, so that shards
  of rows add up.
  """
  router, gate_EDF, up_EDF, down_EFD = weights
  b, r, d = x_BRD.shape
  x_TD, weight_TK, expert_TK, logits_TE = route(cfg, x_BRD.reshape(b * r, d), router)
  order_P, expert_P, sizes_E = sort_pairs(expert_TK, cfg.moe_experts)
  keep_P = keep_mask(expert_P, sizes_E, kept_counts(sizes_E[None], capacity(cfg, b * r))[0])
  y_PD = expert_mlp(cfg, x_TD[order_P // cfg.moe_top_k], sizes_E, gate_EDF, up_EDF, down_EFD)
  out_TD = combine(jnp.where(keep_P[:, None], y_PD, 0), order_P, weight_TK)
  return out_TD.reshape(b, r, d), router_stats(row_weight_BR, logits_TE, expert_TK,
                                               unsort(keep_P, order_P, cfg.moe_top_k))


def route(cfg: ModelConfig, x_TD, router):
  """(the experts' input rows [T, D], weights [T, k] f32, experts [T, k], logits [T, E] f32):
  each token's top-k experts of a float32 softmax over all E, the weights renormalised to sum
  to 1 if `moe_norm_topk`. `router` is the kernel [D, E], or with `moe_router_norm` (kernel,
  scale [D], per-expert scale [E], the experts' norm weight [D])."""
  if cfg.moe_router_norm:
    router_DE, scale_D, expert_scale_E, norm_D = router
    seen_TD = rms_norm(x_TD, cfg.norm_eps) * scale_D.astype(x_TD.dtype) * jnp.asarray(
        x_TD.shape[-1] ** -0.5, x_TD.dtype)
    experts_in_TD = rms_norm(x_TD, cfg.norm_eps, norm_D)
  else:
    router_DE, seen_TD, experts_in_TD = router, x_TD, x_TD
  logits_TE = (seen_TD @ router_DE.astype(x_TD.dtype)).astype(jnp.float32)
  weight_TK, expert_TK = jax.lax.top_k(jax.nn.softmax(logits_TE, axis=-1), cfg.moe_top_k)
  if cfg.moe_norm_topk:
    weight_TK = weight_TK / weight_TK.sum(-1, keepdims=True)
  if cfg.moe_router_norm:
    weight_TK = weight_TK * expert_scale_E[expert_TK].astype(jnp.float32)
  return experts_in_TD, weight_TK, expert_TK, logits_TE


def sort_pairs(expert_TK, num_experts: int):
  """(order [P], expert of each sorted pair [P], pairs per expert [E]) of the P = T*k
  (token, expert) pairs sorted by expert, stably: expert j's pairs form the j-th group of the
  grouped matmuls, in token order."""
  flat_P = expert_TK.reshape(-1)
  order_P = jnp.argsort(flat_P, stable=True)
  return order_P, flat_P[order_P], jnp.bincount(flat_P, length=num_experts).astype(jnp.int32)


def exclusive_cumsum(x, axis: int = 0):
  """Sums of the entries before each one: where each group starts, from group sizes."""
  return jnp.cumsum(x, axis=axis) - x


def capacity(cfg: ModelConfig, tokens: int) -> int | None:
  """Pairs each expert takes from `tokens` routed together (None: all, no dropping)."""
  if not cfg.moe_drop_tokens:
    return None
  return math.ceil(cfg.moe_capacity_factor * tokens * cfg.moe_top_k / cfg.moe_experts)


def kept_counts(counts_GE, cap: int | None):
  """Pairs each of G members keeps per expert, when the members' pairs queue for an expert's
  `cap` slots in member order (the first member's first)."""
  if cap is None:
    return counts_GE
  return jnp.clip(cap - exclusive_cumsum(counts_GE), 0, counts_GE)


def keep_mask(expert_P, sizes_E, kept_E):
  """Whether each expert-sorted pair is among the first kept_E[e] of its expert e."""
  rank_P = jnp.arange(expert_P.shape[0]) - exclusive_cumsum(sizes_E)[expert_P]
  return rank_P < kept_E[expert_P]


def expert_mlp(cfg: ModelConfig, x_ND, sizes_E, gate_EDF, up_EDF, down_EFD):
  """Each expert's gated MLP on its group of rows (groups in order, sizes_E rows each): three
  grouped matmuls, never E x rows. Rows after the last group come out as zeros."""
  mm = lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), sizes_E)
  return mm(ACTIVATIONS[cfg.mlp_activation](mm(x_ND, gate_EDF)) * mm(x_ND, up_EDF), down_EFD)


def unsort(sorted_P, order_P, k: int):
  """Expert-sorted pairs back in token order, [T, k, ...]."""
  flat = jnp.zeros_like(sorted_P).at[order_P].set(sorted_P)
  return flat.reshape(-1, k, *sorted_P.shape[1:])


def combine(y_PD, order_P, weight_TK):
  """[T, D]: each token's expert outputs (sorted pairs) summed with its k weights."""
  y_TKD = unsort(y_PD, order_P, weight_TK.shape[1])
  return jnp.einsum("tkd,tk->td", y_TKD, weight_TK.astype(y_PD.dtype))


def router_stats(row_weight_BR, logits_TE, expert_TK, keep_TK):
  """The router sums of `experts` (see there) over these rows."""
  w_T1 = row_weight_BR.reshape(-1, 1).astype(jnp.float32)
  return dict(tokens=w_T1.sum(),
              picks=jnp.zeros(logits_TE.shape[-1]).at[expert_TK].add(w_T1),
              probs=(w_T1 * jax.nn.softmax(logits_TE, axis=-1)).sum(0),
              z=(w_T1[:, 0] * jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))).sum(),
              dropped=(w_T1 * ~keep_TK).sum())


def no_stats(num_experts: int) -> dict:
  """The router sums of a layer without experts: zeros of `router_stats`' structure, so that
  dense and MoE layers stack on one layer axis ({} in a model with no experts)."""
  if not num_experts:
    return {}
  zero = jnp.zeros((), jnp.float32)
  return dict(tokens=zero, picks=jnp.zeros(num_experts), probs=jnp.zeros(num_experts), z=zero,
              dropped=zero)


def router_losses(stats: dict, num_experts: int) -> dict:
  """Load-balancing loss and z-loss from per-layer `MoE` stats stacked on a layer axis.

  As Qwen3-MoE's `load_balancing_loss_func`: E * sum_e f_e * P_e, with f (share of top-k
  picks) and P (mean probability) pooled over every layer's counted tokens, and the expert
  load max_e f_e / mean_e f_e (1 = balanced); and the share of picks dropped over an
  expert's capacity (`model.moe_drop_tokens`).
  """
  tokens = jnp.maximum(stats["tokens"].sum(), 1.0)
  f_E = stats["picks"].sum(0) / tokens
  p_E = stats["probs"].sum(0) / tokens
  return dict(moe_aux_loss=num_experts * jnp.sum(f_E * p_E),
              moe_z_loss=stats["z"].sum() / tokens,
              moe_max_load=f_E.max() / jnp.maximum(f_E.mean(), 1e-9),
              moe_dropped=stats["dropped"].sum() / jnp.maximum(stats["picks"].sum(), 1.0))
