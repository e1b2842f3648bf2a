"""A Llama/Qwen3/Gemma 3-family decoder in Flax NNX (dense or mixture-of-experts MLPs, see
models/moe.py), with no parallelism inside.

The model sees packed rows in whatever order a layout chose: each row carries its token,
its RoPE position and the metadata the attention mask needs. Attention is a function
handed in by the caller, `attend(q, k, v, q_meta, k_meta, window=None) -> (out, lse)`, so
the same module runs on one device or inside any sequence-parallel strategy; local
(sliding-window) layers pass their window W, global ones None.
"""

import collections
import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig
from bdlm_jax.models.pattern import layer_types, mlp_types
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.models.moe import ACTIVATIONS, MoE, no_stats

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

  def _theta(self, kind: str) -> float:
    cfg = self.cfg
    return cfg.rope_local_theta if kind == "local" and cfg.rope_local_theta else cfg.rope_theta

  def qkv(self, x_BRD, pos_BR, kind: str = "global"):
    cfg = self.cfg
    b, r, _ = x_BRD.shape
    q = self.q_proj(x_BRD).reshape(b, r, cfg.n_heads, cfg.head_dim)
    if cfg.qk_norm:
      q = self.q_norm(q)
    q = rope(q, pos_BR, self._theta(kind))
    if cfg.query_pre_attn_scalar:
      # The kernels scale logits by q's head_dim ** -0.5; Gemma wants query_pre_attn_scalar's.
      q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)
    return (q, *self.kv(x_BRD, pos_BR, kind))

  def kv(self, x_BRD, pos_BR, kind: str = "global"):
    """Keys (normed, rotated) and values of `x`: `qkv`'s, and alone for rows that serve only
    as keys (a drafter's context)."""
    cfg = self.cfg
    b, r, _ = x_BRD.shape
    k = self.k_proj(x_BRD).reshape(b, r, cfg.n_kv_heads, cfg.head_dim)
    v = self.v_proj(x_BRD).reshape(b, r, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      k = self.k_norm(k)
    return rope(k, pos_BR, self._theta(kind)), v



class MLP(nnx.Module):
  """Gated: SwiGLU or GeGLU, by `model.mlp_activation`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.activation = ACTIVATIONS[cfg.mlp_activation]
    self.gate_proj = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
    self.up_proj = _linear(cfg.d_model, cfg.d_ff, cfg, rngs)
    self.down_proj = _linear(cfg.d_ff, cfg.d_model, cfg, rngs)

  def __call__(self, x):
    return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  """One decoder layer, with a dense or a mixture-of-experts MLP. Local and global layers
  share its weights' shapes; `kind` (a static argument of each call) picks the window and the
  RoPE base. With `model.post_norms` (Gemma) the attention and MLP outputs are normed too,
  before their residual adds."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
    if cfg.post_norms:
      self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
      self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))

  def project(self, x_BRD, pos_BR, kind: str = "global"):
    return self.attn.qkv(self.attn_norm(x_BRD), pos_BR, kind)

  def window(self, kind: str) -> int | None:
    """The `window` argument of `attend` for a layer of this kind."""
    return self.cfg.sliding_window if kind == "local" else None

  def finish(self, x_BRD, attn_BRHD, row_weight_BR=None, dispatch=None):
    """(x, router stats: see `MoE`, counted over `row_weight_BR` and run by `dispatch`; for
    a dense MLP {} in a dense model, zeros in a model with experts elsewhere)."""
    b, r = attn_BRHD.shape[:2]
    out_BRD = self.attn.o_proj(attn_BRHD.reshape(b, r, -1))
    if self.cfg.post_norms:
      out_BRD = self.post_attn_norm(out_BRD)
    x_BRD = x_BRD + out_BRD
    h_BRD = self.mlp_norm(x_BRD)
    if isinstance(self.mlp, MoE):
      out_BRD, stats = self.mlp(h_BRD, row_weight_BR, dispatch)
    else:
      out_BRD, stats = self.mlp(h_BRD), no_stats(self.cfg.moe_experts)
    if self.cfg.post_norms:
      out_BRD = self.post_mlp_norm(out_BRD)
    return x_BRD + out_BRD, stats

  def __call__(self, x_BRD, pos_BR, meta: RowMeta, attend: AttendFn, kind: str = "global",
               row_weight_BR=None, dispatch=None):
    q, k, v = self.project(x_BRD, pos_BR, kind)
    attn_BRHD, _ = attend(q, k, v, meta, meta, window=self.window(kind))
    return self.finish(x_BRD, attn_BRHD, row_weight_BR, dispatch)


STACKS = ("layers", "dense_layers")  # the params holding stacked layer weights


def layer_slots(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  """Where each layer's weights live: (stack, index on its layer axis). Every layer is in
  `layers`, unless `model.mlp_pattern` mixes dense and MoE MLPs: then the MoE layers are in
  `layers` and the dense ones in `dense_layers`, each stack in layer order."""
  kinds = mlp_types(cfg)
  mixed = len(set(kinds)) > 1
  seen = {name: 0 for name in STACKS}
  slots = []
  for kind in kinds:
    name = STACKS[1] if mixed and kind == "dense" else STACKS[0]
    slots.append((name, seen[name]))
    seen[name] += 1
  return tuple(slots)


def is_stacked(path) -> bool:
  """Whether a params-pytree path (from `jax.tree_util.tree_map_with_path`) is a stacked
  layer weight, whose leading axis is the layer axis."""
  return any(getattr(k, "key", None) in STACKS for k in path)


def remat_policy(remat: str):
  """What a layer keeps for its backward: `full` saves only the layer input (the scan carry),
  the attention core's output and LSE and, on a local layer, the K/V rows its windowed
  exchange received; it recomputes projections, norms and the MLP.

  The attention core is never recomputed: a ring inside it would re-run its collectives
  (docs/strategies.md). Its output and LSE are named inside every attention `custom_vjp`
  (`kernels.residuals`), which is what lets the policy keep them and drop the rest.
  """
  if remat == "none":
    return lambda fn: fn
  return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
      *residuals.NAMES))


class LayerStack(nnx.Module):
  """A module whose `cfg.n_layers` decoder layers are stacked, to run as one scan."""

  def build_layers(self, cfg: ModelConfig, rngs: nnx.Rngs):
    """Blocks whose every parameter has a leading layer axis (`kernel_LDF`), one stack per MLP
    kind (`layer_slots`): the layers run as one lax.scan over periods of the layer patterns
    (`scan_layers`), so compile time and program size do not grow with depth."""
    def stacked_blocks(count, moe):
      @nnx.split_rngs(splits=count)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(cfg, rngs, moe)
      return make(rngs)

    has_experts = "moe" in mlp_types(cfg)
    for name, count in collections.Counter(name for name, _ in layer_slots(cfg)).items():
      setattr(self, name, stacked_blocks(count, moe=has_experts and name == "layers"))

  def scan_layers(self, fn, x, *xs, remat: str = "none", layer_weights=None,
                  depth: int | None = None):
    """(x, ys) of `fn(block, x, *xs_l, kind) -> (x, y)` run over the layers (the first
    `depth` of them if given).

    The layers run as one `lax.scan` over periods of `model.layer_pattern` (each step runs
    one period's layers, each with its static kind), then the remainder's runs of one kind,
    so compile time and program size do not grow with depth. `xs` are per-layer inputs with a
    leading layer axis, as are the returned `ys`. `layer_weights` maps one layer's weights
    before use (the caller's hook to cast and gather sharded weights per layer).
    """
    kinds, slots = layer_types(self.cfg)[:depth], layer_slots(self.cfg)[:depth]
    stacks = {name: nnx.split(getattr(self, name)) for name in dict.fromkeys(n for n, _ in slots)}
    period = math.lcm(len(self.cfg.layer_period), len(self.cfg.mlp_period))
    n_scanned = len(kinds) // period * period
    per_period = {name: sum(n == name for n, _ in slots[:period]) for name in stacks}

    def one_layer(kind, stack):
      # A layer reads its weights (`index` on its stack) from the stacked arrays themselves,
      # inside the remat'd function: what it saves is then the arrays as given, never a copy
      # of a slice. Per-layer inputs `xs` are indexed by the layer's position `layer`.
      def run(x, layer, index, layered):
        take = lambda i: lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        weights = jax.tree.map(take(index), layered[0][stack])
        rest = jax.tree.map(take(layer), layered[1])
        if layer_weights is not None:
          weights = layer_weights(weights)
        return fn(nnx.merge(stacks[stack][0], weights), x, *rest, kind)
      return remat_policy(remat)(run)

    layered = ({name: state for name, (_, state) in stacks.items()}, xs)

    def run_period(x, p):
      outs = []
      for i in range(period):
        stack, rank = slots[i]
        x, y = one_layer(kinds[i], stack)(x, p * period + i, p * per_period[stack] + rank,
                                          layered)
        outs.append(y)
      return x, jax.tree.map(lambda *y: jnp.stack(y), *outs)

    ys = []
    if n_scanned:
      x, y = jax.lax.scan(run_period, x, jnp.arange(n_scanned // period))
      ys.append(jax.tree.map(lambda a: a.reshape(n_scanned, *a.shape[2:]), y))
    # The remainder, in scans over runs of one kind: in a loop the weights' gradient
    # accumulates in one buffer, where two unrolled layers would add a full-size one.
    for (kind, stack), run in itertools.groupby(range(n_scanned, len(kinds)),
                                                key=lambda i: (kinds[i], slots[i][0])):
      run = list(run)
      body = one_layer(kind, stack)
      x, y = jax.lax.scan(lambda x, li: body(x, *li, layered), x,
                          (jnp.asarray(run), jnp.asarray([slots[i][1] for i in run])))
      ys.append(y)
    return x, jax.tree.map(lambda *y: jnp.concatenate(y), *ys)


class Transformer(LayerStack):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=_dtype(cfg.compute_dtype),
                           param_dtype=_dtype(cfg.param_dtype),
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.build_layers(cfg, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs)

  def __call__(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn,
               layer_weights=None) -> jax.Array:
    """Final hidden states [B, R, D] of every row."""
    return self.forward(tokens_BR, pos_BR, meta, attend, layer_weights)[0]

  def forward(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn, layer_weights=None,
              row_weight_BR=None, dispatch=None):
    """(final hidden states [B, R, D], per-layer router stats stacked on a layer axis: {}
    for dense MLPs; MoE layers count the rows of `row_weight_BR`, default all, and run
    through `dispatch`, the caller's hook: see `MoE`).

    Positions and row metadata ride in the scan carry, unchanged: as constants of the loop,
    JAX would hoist everything computed from them alone out of it, including the attention
    mask of every key chunk (and ring step) at once, O(rows^2) bytes.
    """
    def layer(block, carry, kind):
      x_BRD, pos_BR, meta, row_weight_BR = carry
      x_BRD, stats = block(x_BRD, pos_BR, meta, attend, kind, row_weight_BR, dispatch)
      return (x_BRD, pos_BR, meta, row_weight_BR), stats

    carry = (self.embed_tokens(tokens_BR), pos_BR, meta, row_weight_BR)
    (x_BRD, *_), stats = self.scan_layers(layer, carry, remat=self.cfg.remat,
                                          layer_weights=layer_weights)
    return self.final_norm(x_BRD), stats

  def features(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn,
               layer_ids: tuple[int, ...], depth: int,
               layer_weights=None) -> tuple[jax.Array, jax.Array]:
    """([B, R, len(layer_ids), D], [B, R, D]): the outputs of layers `layer_ids` (0-based;
    Hugging Face's `hidden_states[i + 1]`), for a drafter's context, and the last layer's
    output through the final norm (the model's output when `depth` is every layer). Only
    the first `depth` layers run. A chosen layer writes its output into its slot of one
    buffer in the scan carry, updated in place (another layer rewrites a slot with what it
    holds), so only the chosen layers' states are kept, in the layout `fc` reads."""
    slot, chosen = [0] * depth, [False] * depth
    for i, layer_id in enumerate(layer_ids):
      slot[layer_id], chosen[layer_id] = i, True

    def layer(block, carry, slot, chosen, kind):
      x_BRD, pos_BR, meta, feats = carry
      x_BRD, _ = block(x_BRD, pos_BR, meta, attend, kind)
      kept = jax.lax.dynamic_index_in_dim(feats, slot, axis=2, keepdims=False)
      feats = jax.lax.dynamic_update_index_in_dim(feats, jnp.where(chosen, x_BRD, kept), slot,
                                                  axis=2)
      return (x_BRD, pos_BR, meta, feats), None

    x_BRD = self.embed_tokens(tokens_BR)
    feats = jnp.zeros((*x_BRD.shape[:2], len(layer_ids), x_BRD.shape[-1]), x_BRD.dtype)
    (x_BRD, *_, feats), _ = self.scan_layers(
        layer, (x_BRD, pos_BR, meta, feats), jnp.asarray(slot), jnp.asarray(chosen),
        remat=self.cfg.remat, layer_weights=layer_weights, depth=depth)
    return feats, self.final_norm(x_BRD)

  def embed_tokens(self, tokens_BR) -> jax.Array:
    """The first layer's input [B, R, D]: embeddings, times sqrt(d_model) for Gemma (as
    Hugging Face does it: a float32 scalar cast to the embeddings' dtype)."""
    x_BRD = self.embed(tokens_BR)
    if self.cfg.scale_embeddings:
      x_BRD = x_BRD * jnp.asarray(self.cfg.d_model ** 0.5, jnp.float32).astype(x_BRD.dtype)
    return x_BRD

  @property
  def head(self) -> nnx.Module:
    """The module that turns hidden states into logits: the tied embedding or `lm_head`."""
    return self.embed if self.cfg.tie_embeddings else self.lm_head

  def logits(self, h_BRD) -> jax.Array:
    """Float32 logits [B, R, vocab]."""
    return head_logits(self.head, h_BRD, self.cfg.logit_softcap)


def head_logits(head: nnx.Module, h_BRD, softcap: float) -> jax.Array:
  """Float32 logits of `Transformer.head` (usable on the head alone, split from the model),
  soft-capped to (-softcap, softcap) when `softcap` > 0 (`model.logit_softcap`)."""
  out = head.attend(h_BRD) if isinstance(head, nnx.Embed) else head(h_BRD)
  out = out.astype(jnp.float32)
  return softcap * jnp.tanh(out / softcap) if softcap else out
