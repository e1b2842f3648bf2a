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
from bdlm_jax.kernels.chunking import over_row_chunks
from bdlm_jax.models.gdn import GatedDeltaNet
from bdlm_jax.models.norm import rms_norm
from bdlm_jax.models.pattern import (attention_shape, layer_rope, layer_types, mlp_types,
                                     periodic_layers, split_attention)
from bdlm_jax.models.rope import rope
from bdlm_jax.kernels import residuals
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.models.moe import ACTIVATIONS, MoE, no_stats

AttendFn = Callable[..., tuple[jax.Array, jax.Array]]


def _dtype(name: str):
  return jnp.dtype(name)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, then cast back (matches the HF reference)."""

  def __init__(self, dim: int, eps: float, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.eps, self.scale[...])


def _linear(din, dout, cfg: ModelConfig, rngs, bias: bool = False):
  return nnx.Linear(din, dout, use_bias=bias, dtype=_dtype(cfg.compute_dtype),
                    param_dtype=_dtype(cfg.param_dtype), rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query attention's projections, with the shapes of layers of kind `shape_kind`
  (`pattern.attention_shape`: global layers may have their own head dim and K/V heads, and
  keys that serve as values too)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, shape_kind: str = "global"):
    self.cfg = cfg
    self.n_kv_heads, self.head_dim, self.k_eq_v = attention_shape(cfg, shape_kind)
    # With model.attention_gate, q_proj gives [q | gate] per head (Qwen3.5's layout).
    self.q_proj = _linear(cfg.d_model, cfg.n_heads * self.head_dim * (1 + cfg.attention_gate),
                          cfg, rngs, cfg.qkv_bias)
    self.k_proj = _linear(cfg.d_model, self.n_kv_heads * self.head_dim, cfg, rngs, cfg.qkv_bias)
    if not self.k_eq_v:
      self.v_proj = _linear(cfg.d_model, self.n_kv_heads * self.head_dim, cfg, rngs,
                            cfg.qkv_bias)
    self.o_proj = _linear(cfg.n_heads * self.head_dim, cfg.d_model, cfg, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, _dtype(cfg.param_dtype))
      self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, _dtype(cfg.param_dtype))

  def _rope(self, x_BRHD, pos_BR, kind: str):
    """RoPE of a layer of this kind (`layer_rope`: local layers' own base and scaling,
    global layers' rotary fraction)."""
    return rope(x_BRHD, pos_BR, *layer_rope(self.cfg, kind, x_BRHD.shape[-1]))

  def qkv(self, x_BRD, pos_BR, kind: str = "global"):
    """(q, k, v), and with model.attention_gate the output gate's logits [B, R, H, D] last."""
    cfg = self.cfg
    b, r, _ = x_BRD.shape
    q = self.q_proj(x_BRD).reshape(b, r, cfg.n_heads, -1)
    q, *gate = jnp.split(q, 2, axis=-1) if cfg.attention_gate else (q,)
    if cfg.qk_norm:
      q = self.q_norm(q)
    q = self._rope(q, pos_BR, kind)
    if cfg.query_pre_attn_scalar:
      # The kernels scale logits by q's head_dim ** -0.5; Gemma wants query_pre_attn_scalar's.
      q = q * jnp.asarray(math.sqrt(self.head_dim / cfg.query_pre_attn_scalar), q.dtype)
    return (q, *self.kv(x_BRD, pos_BR, kind), *gate)

  def kv(self, x_BRD, pos_BR, kind: str = "global"):
    """Keys (normed, rotated) and values of `x`: `qkv`'s, and alone for rows that serve only
    as keys (a drafter's context). With K = V the values are the keys' projection, taken
    before the key norm and RoPE (Gemma 4)."""
    cfg = self.cfg
    b, r, _ = x_BRD.shape
    k = self.k_proj(x_BRD).reshape(b, r, self.n_kv_heads, self.head_dim)
    v = k if self.k_eq_v else self.v_proj(x_BRD).reshape(b, r, self.n_kv_heads, self.head_dim)
    if cfg.qk_norm:
      k = self.k_norm(k)
    if cfg.v_norm:
      v = rms_norm(v, cfg.norm_eps)
    return self._rope(k, pos_BR, kind), v



# `rows(fn, parts, module, *xs_BR) -> fn(module, *xs)'s (rows, sums) over all rows`: how a
# layer runs its row-wise work in `parts` chunks. The caller's hook: `parallel/rows.py` runs
# it on each device's own rows; `in_parts`, the default, where no one shards the rows.
RowsFn = Callable[..., tuple]


def in_parts(fn, parts: int, module: nnx.Module, *xs_BR):
  """`fn(module, *xs) -> (rows, sums)` over `parts` contiguous chunks of the rows, each one
  rematerialised (`kernels.chunking`); 1: all rows at once."""
  n = jax.tree.leaves(xs_BR)[0].shape[1]
  return over_row_chunks(functools.partial(fn, module), -(-n // parts), *xs_BR, remat=True)


class MLP(nnx.Module):
  """Gated: SwiGLU or GeGLU, by `model.mlp_activation`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int = 0):
    d_ff = d_ff or cfg.d_ff
    self.activation = ACTIVATIONS[cfg.mlp_activation]
    self.gate_proj = _linear(cfg.d_model, d_ff, cfg, rngs)
    self.up_proj = _linear(cfg.d_model, d_ff, cfg, rngs)
    self.down_proj = _linear(d_ff, cfg.d_model, cfg, rngs)

  def __call__(self, x):
    return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  """One decoder layer, with a dense or a mixture-of-experts MLP (or, with
  `model.moe_beside_dense`, both side by side, Gemma 4). Its attention weights have the
  shapes of layers of kind `shape_kind`; `kind` (a static argument of each call) picks the
  window and the RoPE. With `model.post_norms` (Gemma) the attention and MLP outputs are
  normed too, before their residual adds; with `model.layer_scalar` the layer's output is
  scaled by a per-layer constant."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False,
               shape_kind: str = "global"):
    self.cfg = cfg
    param_dtype = _dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    if shape_kind == "gdn":
      self.linear_attn = GatedDeltaNet(cfg, rngs, _linear)
    else:
      self.attn = Attention(cfg, rngs, shape_kind)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
    if cfg.post_norms:
      self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
      self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    if moe and cfg.moe_beside_dense:
      self.dense_mlp = MLP(cfg, rngs)
      self.post_dense_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
      self.post_experts_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    if cfg.layer_scalar:
      self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))
    if moe and cfg.moe_shared_d_ff:
      self.shared_expert = MLP(cfg, rngs, cfg.moe_shared_d_ff)
      self.shared_expert_gate = _linear(cfg.d_model, 1, cfg, rngs)

  def project(self, x_BRD, pos_BR, kind: str = "global", rows: RowsFn = in_parts):
    """(q, k, v) of the rows (and the output gate's logits, model.attention_gate), in
    `model.row_chunks` parts run by `rows`."""
    def qkv(block, x_BRD, pos_BR):
      return block.attn.qkv(block.attn_norm(x_BRD), pos_BR, kind), ()
    return rows(qkv, self.cfg.row_chunks, self, x_BRD, pos_BR)[0]

  def window(self, kind: str) -> int | None:
    """The `window` argument of `attend` for a layer of this kind."""
    return self.cfg.sliding_window if kind == "local" else None

  def finish(self, x_BRD, attn_BRHD, row_weight_BR=None, dispatch=None,
             rows: RowsFn = in_parts):
    """(x, router stats: see `MoE`, counted over `row_weight_BR` and run by `dispatch`; for
    a dense MLP {} in a dense model, zeros in a model with experts elsewhere), computed in
    `model.row_chunks` parts run by `rows`; over all rows at once where a `dispatch` runs
    the experts (on a mesh: a `shard_map` of its own, which cannot run inside `rows`'; it
    chunks the experts' rows itself, see `parallel/experts.py`)."""
    if dispatch is not None:
      return self._finish(x_BRD, attn_BRHD, row_weight_BR, dispatch)
    return rows(functools.partial(Block._finish, dispatch=None), self.cfg.row_chunks, self,
                x_BRD, attn_BRHD, row_weight_BR)

  def _finish(self, x_BRD, attn_BRHD, row_weight_BR, dispatch):
    b, r = attn_BRHD.shape[:2]
    o_proj = self.linear_attn.out_proj if hasattr(self, "linear_attn") else self.attn.o_proj
    out_BRD = o_proj(attn_BRHD.reshape(b, r, -1))
    if self.cfg.post_norms:
      out_BRD = self.post_attn_norm(out_BRD)
    x_BRD = x_BRD + out_BRD
    out_BRD, stats = self._feed_forward(x_BRD, row_weight_BR, dispatch)
    if self.cfg.post_norms:
      out_BRD = self.post_mlp_norm(out_BRD)
    x_BRD = x_BRD + out_BRD
    if self.cfg.layer_scalar:  # a fixed buffer in Hugging Face's Gemma 4: never trained
      x_BRD = x_BRD * jax.lax.stop_gradient(self.layer_scalar[...]).astype(x_BRD.dtype)
    return x_BRD, stats

  def _feed_forward(self, x_BRD, row_weight_BR, dispatch):
    """(MLP output, router stats) of the residual `x`. Gemma 4's experts
    (`model.moe_router_norm`) read the residual itself: their router and their input norm
    are their own; with `model.moe_beside_dense` a dense MLP runs beside them; with
    `model.moe_shared_d_ff` a shared expert, gated per row, adds to them (Qwen3.5-MoE)."""
    h_BRD = self.mlp_norm(x_BRD)
    if not isinstance(self.mlp, MoE):
      return self.mlp(h_BRD), no_stats(self.cfg.moe_experts)
    out_BRD, stats = self.mlp(x_BRD if self.cfg.moe_router_norm else h_BRD, row_weight_BR,
                              dispatch)
    if self.cfg.moe_beside_dense:
      out_BRD = self.post_dense_norm(self.dense_mlp(h_BRD)) + self.post_experts_norm(out_BRD)
    if self.cfg.moe_shared_d_ff:
      gate_BR1 = jax.nn.sigmoid(self.shared_expert_gate(h_BRD))
      out_BRD = out_BRD + gate_BR1 * self.shared_expert(h_BRD)
    return out_BRD, stats

  def __call__(self, x_BRD, pos_BR, meta: RowMeta, attend: AttendFn, kind: str = "global",
               row_weight_BR=None, dispatch=None, rows: RowsFn = in_parts):
    if kind == "gdn":
      return self.finish(x_BRD, self.linear_mix(x_BRD, meta, attend, rows), row_weight_BR,
                         dispatch, rows)
    q, k, v, *gate = self.project(x_BRD, pos_BR, kind, rows)
    attn_BRHD, _ = attend(q, k, v, meta, meta, window=self.window(kind))
    if gate:
      attn_BRHD = attn_BRHD * jax.nn.sigmoid(gate[0])
    return self.finish(x_BRD, attn_BRHD, row_weight_BR, dispatch, rows)

  def linear_mix(self, x_BRD, meta: RowMeta, attend: AttendFn, rows: RowsFn = in_parts):
    """A Gated DeltaNet layer's mixed rows [B, R, Hv, V], before `out_proj` (models/gdn.py):
    its row-wise projections in `model.row_chunks` parts, the recurrence over the layout's
    streams by `attend.recur`, the caller's (as `attend` itself is)."""
    recur = getattr(attend, "recur", None)
    if recur is None:
      raise ValueError("this attention function has no `recur` to run Gated DeltaNet layers "
                       "with (parallel.recurrence.make_recur attaches one)")
    def project(block, x_BRD):
      return block.linear_attn.project(block.attn_norm(x_BRD)), ()
    pre_BRC, z_BRHV, g_BRH, beta_BRH = rows(project, self.cfg.row_chunks, self, x_BRD)[0]
    o_BRHV = recur(self.linear_attn.cell(), pre_BRC, g_BRH, beta_BRH, meta)
    return self.linear_attn.gated_norm(o_BRHV, z_BRHV)


# The params holding stacked layer weights.
STACKS = ("layers", "dense_layers", "global_layers", "global_dense_layers", "gdn_layers",
          "gdn_dense_layers")


def layer_slots(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  """Where each layer's weights live: (stack, index on its layer axis). Every layer is in
  `layers`, unless `model.mlp_pattern` mixes dense and MoE MLPs: then the MoE layers are in
  `layers` and the dense ones in `dense_layers`; and when global layers' attention weights
  have other shapes than local ones' (`pattern.split_attention`: Gemma 4's global head dim,
  K/V heads, K = V), the global layers are in `global_` stacks of their own; Gated DeltaNet
  layers are always in `gdn_` stacks of their own. Each stack is in layer order."""
  mixed = len(set(mlp_types(cfg))) > 1
  split = split_attention(cfg)
  seen = {name: 0 for name in STACKS}
  slots = []
  for mlp, attention in zip(mlp_types(cfg), layer_types(cfg)):
    name = (("global_" if split and attention == "global" else
             "gdn_" if attention == "gdn" else "")
            + ("dense_layers" if mixed and mlp == "dense" else "layers"))
    slots.append((name, seen[name]))
    seen[name] += 1
  return tuple(slots)


def scan_runs(cfg: ModelConfig, depth: int | None = None) -> tuple[int, int, list]:
  """How `LayerStack.scan_layers` runs the first `depth` layers: (period, n_scanned, runs).
  The first `n_scanned` run as one scan over whole periods of `period` layers (the lcm of
  the layer and MLP patterns); then each run in `runs` (consecutive layers of one kind in
  one stack) as a scan of its own."""
  kinds, slots = layer_types(cfg)[:depth], layer_slots(cfg)[:depth]
  period = cfg.scan_step
  n_scanned = min(len(kinds) // period * period, periodic_layers(cfg, period))
  runs = [list(run) for _, run in itertools.groupby(range(n_scanned, len(kinds)),
                                                     key=lambda i: (kinds[i], slots[i][0]))]
  return period, n_scanned, runs


def scan_lengths(cfg: ModelConfig) -> set[int]:
  """The leading dims of the stacks the layer scans save: the periods scanned, and each
  remainder run's length."""
  period, n_scanned, runs = scan_runs(cfg)
  return {len(run) for run in runs} | ({n_scanned // period} if n_scanned else set())


def stack_kinds(cfg: ModelConfig, name: str) -> tuple[bool, str]:
  """(whether its layers have experts, the layer kind whose attention shapes they have) of
  the layers of stack `name`."""
  moe = "moe" in mlp_types(cfg) and not name.endswith("dense_layers")
  if name.startswith("gdn_"):
    return moe, "gdn"
  local = not name.startswith("global_") and "local" in layer_types(cfg)
  return moe, "local" if local else "global"


def is_stacked(path) -> bool:
  """Whether a params-pytree path (from `jax.tree_util.tree_map_with_path`) is a stacked
  layer weight, whose leading axis is the layer axis."""
  return any(getattr(k, "key", None) in STACKS for k in path)


# What each offloading layer policy puts in host memory, by name (`remat_policy`).
OFFLOADED = {"offload": residuals.SAVED, "offload_input": (residuals.LAYER_INPUT,)}


def remat_policy(remat: str):
  """What a layer keeps for its backward: `full` saves only the layer input (the scan carry),
  the attention core's output and LSE and, on a local layer, the K/V rows its windowed
  exchange received; it recomputes projections, norms and the MLP. `offload` saves the same
  arrays in host memory: each is written once in the forward and read once in the backward,
  a layer's compute apart, so the copies can hide under it (docs/memory.md).

  `full` and `offload` never recompute the attention core: a ring inside it would re-run its
  collectives (docs/strategies.md). Its output and LSE are named inside every attention
  `custom_vjp` (`kernels.residuals`), which is what lets the policy keep them and drop the
  rest. `offload_input` keeps only the layer input, in host memory: half of `offload`'s host
  bytes, for a backward that re-runs each layer's whole forward, attention and its
  collectives included (what makes one 1M-token sequence fit 8 devices' host memory).
  Under `offload_period` a layer inside a scan step keeps what `full` keeps, and the step
  itself is checkpointed (`step_remat`).
  """
  if remat == "none":
    return lambda fn: fn
  if remat in OFFLOADED:
    return _offloading(*OFFLOADED[remat])
  return functools.partial(jax.checkpoint,
                           policy=jax.checkpoint_policies.save_only_these_names(*residuals.SAVED))


def step_remat(remat: str):
  """What a whole scan step of `model.scan_step` layers keeps for its backward: under
  `offload_period` its input alone, in host memory (1 / scan_step of `offload_input`'s host
  bytes). The backward re-runs the step's forward, its layers then keeping what `full` keeps
  on the device for that step only, and recomputes each layer's projections and MLP once
  more: the attention forward runs twice, as under `offload_input`, the rest three times."""
  if remat == "offload_period":
    return _offloading(residuals.STEP_INPUT)
  return lambda fn: fn


def _offloading(*names):
  """A checkpoint that keeps the arrays named `names`, in host memory, and nothing else."""
  return functools.partial(jax.checkpoint, policy=jax.checkpoint_policies
                           .save_and_offload_only_these_names(
                               names_which_can_be_saved=(), names_which_can_be_offloaded=names,
                               offload_src="device", offload_dst="pinned_host"))


def reruns_attention(remat: str) -> bool:
  """Whether the backward re-runs each layer's attention forward, its K/V transport included
  (remat `offload_input` and `offload_period` save nothing of the attention in host memory):
  one more forward pass of traffic."""
  return remat in ("offload_input", "offload_period")


def stream_reruns(remat: str) -> int:
  """Forward re-runs of a Gated DeltaNet layer's stream, its collectives included, in the
  backward: one under any remat (the stream is recomputed, never saved), two under
  `offload_period` (the step's re-run, then the layer's own)."""
  return 0 if remat == "none" else 2 if remat == "offload_period" else 1


class LayerStack(nnx.Module):
  """A module whose `cfg.n_layers` decoder layers are stacked, to run as one scan."""

  def build_layers(self, cfg: ModelConfig, rngs: nnx.Rngs):
    """Blocks whose every parameter has a leading layer axis (`kernel_LDF`), one stack per MLP
    kind and, where their shapes differ, attention kind (`layer_slots`): the layers run as
    one lax.scan over periods of the layer patterns (`scan_layers`), so compile time and
    program size do not grow with depth."""
    def stacked_blocks(count, moe, shape_kind):
      @nnx.split_rngs(splits=count)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(cfg, rngs, moe, shape_kind)
      return make(rngs)

    for name, count in collections.Counter(name for name, _ in layer_slots(cfg)).items():
      setattr(self, name, stacked_blocks(count, *stack_kinds(cfg, name)))

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
    period, n_scanned, runs = scan_runs(self.cfg, depth)
    per_period = {name: sum(n == name for n, _ in slots[:period]) for name in stacks}

    # Under offload_period a whole step is checkpointed (`step_remat`) and the layers inside
    # it keep what `full` keeps; a remainder layer, a step of its own, keeps its input alone.
    layer_remat = "full" if remat == "offload_period" else remat
    remainder_remat = "offload_input" if remat == "offload_period" else remat

    def one_layer(kind, stack, remat):
      # A layer reads its weights (`index` on its stack) from the stacked arrays themselves,
      # inside the remat'd function: what it saves is then the arrays as given, never a copy
      # of a slice. Per-layer inputs `xs` are indexed by the layer's position `layer`.
      def run(x, layer, index, layered):
        x = residuals.keep_input(x, offloaded=residuals.LAYER_INPUT in OFFLOADED.get(remat, ()))
        take = lambda i: lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        weights = jax.tree.map(take(index), layered[0][stack])
        rest = jax.tree.map(take(layer), layered[1])
        if layer_weights is not None:
          weights = layer_weights(weights)
        return fn(nnx.merge(stacks[stack][0], weights), x, *rest, kind)
      return remat_policy(remat)(run)

    layered = ({name: state for name, (_, state) in stacks.items()}, xs)

    @step_remat(remat)
    def run_period(x, p, layered):
      x = residuals.keep_step_input(x, offloaded=remat == "offload_period")
      outs = []
      for i in range(period):
        stack, rank = slots[i]
        x, y = one_layer(kinds[i], stack, layer_remat)(
            x, p * period + i, p * per_period[stack] + rank, layered)
        outs.append(y)
      return x, jax.tree.map(lambda *y: jnp.stack(y), *outs)

    ys = []
    if n_scanned:
      x, y = jax.lax.scan(lambda x, p: run_period(x, p, layered), x,
                          jnp.arange(n_scanned // period))
      ys.append(jax.tree.map(lambda a: a.reshape(n_scanned, *a.shape[2:]), y))
    # The remainder, in scans over runs of one kind: in a loop the weights' gradient
    # accumulates in one buffer, where two unrolled layers would add a full-size one.
    for run in runs:
      body = one_layer(kinds[run[0]], slots[run[0]][0], remainder_remat)
      x, y = jax.lax.scan(lambda x, li: body(x, *li, layered), x,
                          (jnp.asarray(run), jnp.asarray([slots[i][1] for i in run])))
      ys.append(y)
    return x, jax.tree.map(lambda *y: jnp.concatenate(y), *ys)


class SelfConditioning(nnx.Module):
  """DiffusionGemma's self-conditioning (HF `DiffusionGemmaSelfConditioning`): the input
  embeddings plus a gated MLP of the RMS-normed soft embeddings, through an RMSNorm without
  weight."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.eps = cfg.norm_eps
    self.pre_norm = RMSNorm(cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype))
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BRD, soft_BRD):
    return rms_norm(x_BRD + self.mlp(self.pre_norm(soft_BRD)), self.eps)


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
    if cfg.self_conditioning:
      self.self_conditioning = SelfConditioning(cfg, rngs)

  def __call__(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn,
               layer_weights=None) -> jax.Array:
    """Final hidden states [B, R, D] of every row."""
    return self.forward(tokens_BR, pos_BR, meta, attend, layer_weights)[0]

  def forward(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn, layer_weights=None,
              row_weight_BR=None, dispatch=None, rows: RowsFn = in_parts):
    """(final hidden states [B, R, D], per-layer router stats stacked on a layer axis: {}
    for dense MLPs; MoE layers count the rows of `row_weight_BR`, default all, and run
    through `dispatch`, the caller's hook: see `MoE`; `rows` runs each layer's row-wise
    work, see `RowsFn`).

    Positions and row metadata ride in the scan carry, unchanged: as constants of the loop,
    JAX would hoist everything computed from them alone out of it, including the attention
    mask of every key chunk (and ring step) at once, O(rows^2) bytes.
    """
    return self.over_layers(self.embed_tokens(tokens_BR), pos_BR, meta, attend, layer_weights,
                            row_weight_BR, dispatch, rows)

  def over_layers(self, x_BRD, pos_BR, meta: RowMeta, attend: AttendFn, layer_weights=None,
                  row_weight_BR=None, dispatch=None, rows: RowsFn = in_parts):
    """`forward` from the first layer's input `x_BRD` (embeddings a caller changed: a
    canvas's self-conditioning)."""
    def layer(block, carry, kind):
      x_BRD, pos_BR, meta, row_weight_BR = carry
      x_BRD, stats = block(x_BRD, pos_BR, meta, attend, kind, row_weight_BR, dispatch, rows)
      return (x_BRD, pos_BR, meta, row_weight_BR), stats

    carry = (x_BRD, pos_BR, meta, row_weight_BR)
    (x_BRD, *_), stats = self.scan_layers(layer, carry, remat=self.cfg.remat,
                                          layer_weights=layer_weights)
    return self.final_norm(x_BRD), stats

  def features(self, tokens_BR, pos_BR, meta: RowMeta, attend: AttendFn,
               layer_ids: tuple[int, ...], depth: int, layer_weights=None,
               rows: RowsFn = in_parts) -> tuple[jax.Array, jax.Array]:
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
      x_BRD, _ = block(x_BRD, pos_BR, meta, attend, kind, rows=rows)
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

  def self_condition(self, x_BRD, soft_BRD) -> jax.Array:
    """A canvas's input embeddings `x` conditioned on soft embeddings (`expected_embedding`
    of the previous denoising step's logits; zeros at the first step) through
    `SelfConditioning` (`model.self_conditioning`)."""
    return self.self_conditioning(x_BRD, soft_BRD)

  @property
  def head(self) -> nnx.Module:
    """The module that turns hidden states into logits: the tied embedding or `lm_head`."""
    return self.embed if self.cfg.tie_embeddings else self.lm_head

  def logits(self, h_BRD) -> jax.Array:
    """Float32 logits [B, R, vocab]."""
    return head_logits(self.head, h_BRD, self.cfg.logit_softcap, self.cfg.output_multiplier)


def expected_embedding(embed: nnx.Embed, logits_BRV, scale: bool) -> jax.Array:
  """The softmax of `logits` times the embedding table [B, R, D], scaled by sqrt(d_model)
  as `embed_tokens` scales (`scale`): what DiffusionGemma's decoder makes of its
  `self_conditioning_logits` (the softmax in float32, the product in the table's dtype)."""
  table_VD = embed.embedding[...]
  probs_BRV = jax.nn.softmax(logits_BRV.astype(jnp.float32), axis=-1).astype(table_VD.dtype)
  soft_BRD = probs_BRV @ table_VD
  if scale:
    soft_BRD = soft_BRD * jnp.asarray(table_VD.shape[1] ** 0.5, jnp.float32).astype(
        soft_BRD.dtype)
  return soft_BRD


def head_logits(head: nnx.Module, h_BRD, softcap: float, multiplier: float = 1.0) -> jax.Array:
  """Float32 logits of `Transformer.head` (usable on the head alone, split from the model),
  times `multiplier` (`model.output_multiplier`), then soft-capped to (-softcap, softcap)
  when `softcap` > 0 (`model.logit_softcap`)."""
  out = head.attend(h_BRD) if isinstance(head, nnx.Embed) else head(h_BRD)
  out = out.astype(jnp.float32)
  if multiplier != 1.0:
    out = out * jnp.float32(multiplier)
  return softcap * jnp.tanh(out / softcap) if softcap else out
