"""A Llama/Qwen3-family decoder in Flax NNX, with no parallelism inside.

The model sees packed rows in whatever order a layout chose: each row carries its token,
its RoPE position and the metadata the attention mask needs. Attention is a function
handed in by the caller, `attend(q, k, v, q_meta, k_meta) -> (out, lse)`, so the same
module runs on one device or inside any sequence-parallel strategy.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import RowMeta

AttendFn = Callable[..., tuple[jax.Array, jax.Array]]


def _dtype(name: str):
  return jnp.dtype(name)


def rope(x_BRHD: jax.Array, pos_BR: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split convention (as in Hugging Face Llama/Qwen3)."""
  d = x_BRHD.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angle_BRF = pos_BR[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(angle_BRF)[:, :, None, :]
  sin = jnp.sin(angle_BRF)[:, :, None, :]
  x1, x2 = jnp.split(x_BRHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BRHD.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, then cast back (matches the HF reference)."""

  def __init__(self, dim: int, eps: float, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(din, dout, cfg: ModelConfig, rngs):
  return nnx.Linear(din, dout, use_bias=False, dtype=_dtype(cfg.compute_dtype),
                    param_dtype=_dtype(cfg.param_dtype), rngs=rngs)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.q_proj = _linear(cfg.d_model, cfg.n_heads * cfg.head_dim, cfg, rngs)
    self.k_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs)
    self.v_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs)
    self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.d_model, cfg, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, _dtype(cfg.param_dtype))
      self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, _dtype(cfg.param_dtype))

  def qkv(self, x_BRD, pos_BR):
    cfg = self.cfg
    b, r, _ = x_BRD.shape
    q = self.q_proj(x_BRD).reshape(b, r, cfg.n_heads, cfg.head_dim)
    k = self.k_proj(x_BRD).reshape(b, r, cfg.n_kv_heads, cfg.head_dim)
    v = self.v_proj(x_BRD).reshape(b, r, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return rope(q, pos_BR, cfg.rope_theta), rope(k, pos_BR, cfg.rope_theta), v


class MLP(nnx.Module):
  """SwiGLU."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
    self.up_proj = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
    self.down_proj = _linear(cfg.d_ff, cfg.d_model, cfg, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    self.mlp = MLP(cfg, rngs)

  def project(self, x_BRD, pos_BR):
    return self.attn.qkv(self.attn_norm(x_BRD), pos_BR)

  def finish(self, x_BRD, attn_BRHD):
    b, r = attn_BRHD.shape[:2]
    x_BRD = x_BRD + self.attn.o_proj(attn_BRHD.reshape(b, r, -1))
    return x_BRD + self.mlp(self.mlp_norm(x_BRD))

  def __call__(self, x_BRD, pos_BR, meta: RowMeta, attend: AttendFn):
    q, k, v = self.project(x_BRD, pos_BR)
    attn_BRHD, _ = attend(q, k, v, meta, meta)
    return self.finish(x_BRD, attn_BRHD)


def is_stacked(path) -> bool:
  """Whether a params-pytree path (from `jax.tree_util.tree_map_with_path`) is a stacked
  layer weight, whose leading axis is the layer axis."""
  return any(getattr(k, "key", None) == "layers" for k in path)


def remat_policy(remat: str):
  """What a layer keeps for its backward: `full` saves only the layer input (the scan carry)
  and the attention core's output and LSE, and recomputes projections, norms and the MLP.

  The attention core is never recomputed: a ring inside it would re-run its collectives
  (DESIGN.md section 3). Its output and LSE are named inside every attention `custom_vjp`
  (`kernels.residuals`), which is what lets the policy keep them and drop the rest.
  """
  if remat == "none":
    return lambda fn: fn
  return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
      *residuals.NAMES))


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=_dtype(cfg.compute_dtype),
                           param_dtype=_dtype(cfg.param_dtype),
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked_blocks(rngs):
      return Block(cfg, rngs)

    # One Block whose every parameter has a leading layer axis (`kernel_LDF`): the layers run
    # as one lax.scan, so compile time and program size do not grow with depth.
    self.layers = stacked_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs)

  def scan_layers(self, fn, x, *xs, remat: str = "none", layer_weights=None):
    """(x, ys) of `fn(block, x, *xs_l) -> (x, y)` run over the layers as one `lax.scan`.

    `xs` are per-layer inputs with a leading layer axis. `layer_weights` maps one layer's
    weights before use (the caller's hook to cast and gather sharded weights per layer).
    """
    graphdef, stacked = nnx.split(self.layers)

    def body(x, per_layer):
      weights, *rest = per_layer
      if layer_weights is not None:
        weights = layer_weights(weights)
      return fn(nnx.merge(graphdef, weights), x, *rest)

    return jax.lax.scan(remat_policy(remat)(body), x, (stacked, *xs))

  def __call__(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn,
               layer_weights=None) -> jax.Array:
    """Final hidden states [B, R, D] of every row.

    Positions and row metadata ride in the scan carry, unchanged: as constants of the loop,
    JAX would hoist everything computed from them alone out of it, including the attention
    mask of every key chunk (and ring step) at once, O(rows^2) bytes.
    """
    def layer(block, carry):
      x_BRD, pos_BR, meta = carry
      return (block(x_BRD, pos_BR, meta, attend), pos_BR, meta), None

    (x_BRD, _, _), _ = self.scan_layers(layer, (self.embed(tokens_BR), pos_BR, meta),
                                        remat=self.cfg.remat, layer_weights=layer_weights)
    return self.final_norm(x_BRD)

  @property
  def head(self) -> nnx.Module:
    """The module that turns hidden states into logits: the tied embedding or `lm_head`."""
    return self.embed if self.cfg.tie_embeddings else self.lm_head

  def logits(self, h_BRD) -> jax.Array:
    """Float32 logits [B, R, vocab]."""
    return head_logits(self.head, h_BRD)


def head_logits(head: nnx.Module, h_BRD) -> jax.Array:
  """Float32 logits of `Transformer.head` (usable on the head alone, split from the model)."""
  out = head.attend(h_BRD) if isinstance(head, nnx.Embed) else head(h_BRD)
  return out.astype(jnp.float32)
