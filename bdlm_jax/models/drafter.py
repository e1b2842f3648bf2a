"""A DFlash drafter (docs/dflash.md) beside its frozen target, with no parallelism inside.

The drafter is a few Qwen3-style layers over *draft rows* (blocks `[x_a, MASK ...]`). Its
context is the target's hidden states at a few layers, concatenated per position, projected
by `fc` and normed once; every drafter layer projects that same context with its own k/v
projections, so context rows are keys only and never pass through a layer. The target's
embedding and LM head are the drafter's too, and stay frozen with the rest of the target.

Attention is the caller's, `attend(q, k, v, q_meta, k_meta, k_ctx, v_ctx, ctx_meta)`: the
draft rows' queries against their own keys and the context's, given apart.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import NOISY_CAUSAL, RowMeta
from bdlm_jax.models.selector import CandidateSelector
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
  the target's width, RoPE (its base and scaling: the drafter sees the target's positions),
  dtypes and attention settings, `drafter.*` for the rest."""
  m, d = cfg.model, cfg.drafter
  return ModelConfig(
      vocab_size=m.vocab_size, d_model=m.d_model, n_layers=d.n_layers,
      n_heads=d.n_heads or m.n_heads, n_kv_heads=d.n_kv_heads or m.n_kv_heads,
      head_dim=d.head_dim or m.head_dim, d_ff=d.d_ff or m.d_ff, rope_theta=m.rope_theta,
      rope_scaling=m.rope_scaling, qk_norm=True, norm_eps=m.norm_eps, param_dtype=m.param_dtype,
      compute_dtype=m.compute_dtype, remat=m.remat, attention_impl=m.attention_impl,
      attention_chunk=m.attention_chunk, logits_chunk=m.logits_chunk, row_chunks=m.row_chunks,
      layer_pattern="local" if d.window else "global", sliding_window=d.window)


def drafter_args(cfg: Config) -> dict:
  """JSON-able arguments of `DFlash`'s drafter: its layers' config and DFlash2's parts
  (the block convolution's taps and groups, the candidate selector's rank, whether the own
  block is causal on sliding layers)."""
  d = cfg.drafter
  return dict(model=dataclasses.asdict(drafter_model(cfg)), block_size=cfg.objective.block_size,
              conv_taps=d.conv_taps, conv_group_size=d.conv_group_size,
              selector_rank=cfg.objective.selector_rank,
              sliding_causal=bool(d.sliding_causal and d.window))


def windowed_drafts(meta: RowMeta, window: int, causal: bool = False) -> RowMeta:
  """Draft rows' metadata, as queries, on a sliding-window drafter layer of window W: slot j
  of anchor a (position a + j) sees context positions >= a + j - W + 1 (the seed's
  `dflash_fa4.py` ~343-347, ~516-527); its own block stays whole for W >= B, or with `causal`
  (`drafter.sliding_causal`, the seed's `DFlashLocalBlockMask(causal=True)`, model.py
  ~364-366) only its slots <= j."""
  meta = meta._replace(lo=meta.pos - (window - 1))
  return meta._replace(stream=jnp.full_like(meta.stream, NOISY_CAUSAL)) if causal else meta


class GroupedConv(nnx.Module):
  """DFlash2's block-local dynamic depthwise convolution (the seed's `DFlashGroupedConv`,
  dflash2.py ~40-53, ~257-328): y_t = sum_{k < taps} (base[side, k, ch] + dyn_t[k, group(ch)])
  x_{t-k}, zero before the block's first row, so causal inside a draft block and never across
  one. The base kernel [2 sides, taps, D] starts as the identity (tap 0 = 1) and the
  projection to per-token coefficients [2, taps, G] (G = D / group size) at zero. `prepare`
  convolves its input with side 0 and keeps side 1's coefficients for `finish`. Rows are
  whole draft blocks of `block_size` rows in slot order ([S, A*B, D])."""

  def __init__(self, d_model: int, block_size: int, taps: int, group_size: int, param_dtype,
               rngs: nnx.Rngs):
    self.block_size, self.taps, self.groups = block_size, taps, d_model // group_size
    self.base_kernel = nnx.Param(jnp.zeros((2, taps, d_model), param_dtype).at[:, 0].set(1.0))
    self.kernel_projection = nnx.Linear(d_model, 2 * taps * self.groups, use_bias=False,
                                        kernel_init=nnx.initializers.zeros,
                                        param_dtype=param_dtype, rngs=rngs)

  def _convolve(self, x_SND, dyn_SNKG, side: int):
    s, n, d = x_SND.shape
    b, taps, g = self.block_size, self.taps, self.groups
    x = x_SND.reshape(s, n // b, b, g, d // g)
    coef = (self.base_kernel[...][side].astype(x.dtype).reshape(taps, g, d // g)
            + dyn_SNKG.reshape(s, n // b, b, taps, g, 1).astype(x.dtype))
    shift = lambda k: jnp.pad(x, [(0, 0), (0, 0), (k, 0), (0, 0), (0, 0)])[:, :, :b]
    y = sum(coef[:, :, :, k] * shift(k) for k in range(taps))
    return y.reshape(s, n, d)

  def prepare(self, x_SND):
    coef = self.kernel_projection(x_SND).reshape(*x_SND.shape[:2], 2, self.taps, self.groups)
    return self._convolve(x_SND, coef[:, :, 0], 0), coef[:, :, 1]

  def finish(self, x_SND, coef_SNKG):
    return self._convolve(x_SND, coef_SNKG, 1)


class Drafter(LayerStack):
  """The drafter's layers; with DFlash2's parts (`drafter_args`) a block convolution before
  each layer's attention and one around its MLP (`GroupedConv`, one pair per layer, stacked
  like the layers), and the candidate selector (`selector`)."""

  def __init__(self, cfg: ModelConfig, n_features: int, rngs: nnx.Rngs, block_size: int = 0,
               conv_taps: int = 0, conv_group_size: int = 1, selector_rank: int = 0,
               sliding_causal: bool = False):
    self.cfg, self.sliding_causal = cfg, sliding_causal
    param_dtype = jax.numpy.dtype(cfg.param_dtype)
    self.fc = _linear(n_features * cfg.d_model, cfg.d_model, cfg, rngs)
    self.hidden_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    self.build_layers(cfg, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype)
    if conv_taps:
      @nnx.split_rngs(splits=cfg.n_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        conv = lambda: GroupedConv(cfg.d_model, block_size, conv_taps, conv_group_size,
                                   param_dtype, rngs)
        return nnx.Dict(attn=conv(), mlp=conv())
      self.convs = make(rngs)
    if selector_rank:
      self.selector = CandidateSelector(cfg.d_model, cfg.vocab_size, selector_rank,
                                        param_dtype, rngs)

  def __call__(self, x_BQD, pos_BQ, meta: RowMeta, feats_BCKD, ctx_pos_BC, ctx_meta: RowMeta,
               attend: AttendFn, layer_weights=None, rows: RowsFn = in_parts) -> jax.Array:
    """Final hidden states [B, Q, D] of the draft rows, from their embedded inputs `x_BQD`
    and the target's features [B, C, K, D] at the context rows (on sliding-window layers,
    `windowed_drafts`)."""
    b, c = feats_BCKD.shape[:2]
    ctx_BCD = self.hidden_norm(self.fc(feats_BCKD.reshape(b, c, -1)))
    q_meta = meta  # as queries; `meta` stays the draft rows' metadata as keys
    if self.cfg.sliding_window:
      q_meta = windowed_drafts(meta, self.cfg.sliding_window, self.sliding_causal)
    convs = nnx.split(self.convs) if hasattr(self, "convs") else None

    def layer(block, carry, *conv_state_and_kind):
      # The context and the metadata ride in the carry, unchanged (see Transformer.forward).
      *conv_state, kind = conv_state_and_kind
      x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, q_meta, meta, ctx_meta = carry
      k_ctx, v_ctx = block.attn.kv(ctx_BCD, ctx_pos_BC, kind)
      if not conv_state:
        q, k, v = block.project(x_BQD, pos_BQ, kind, rows)
        out_BQHD, _ = attend(q, k, v, q_meta, meta, k_ctx, v_ctx, ctx_meta)
        x_BQD, _ = block.finish(x_BQD, out_BQHD, rows=rows)
      else:  # DFlash2 (the seed's `DFlash2DecoderLayer.forward`, dflash2.py ~363-386)
        conv = nnx.merge(convs[0], conv_state[0])
        h_BQD, coef = conv["attn"].prepare(block.attn_norm(x_BQD))
        q, k, v = block.attn.qkv(h_BQD, pos_BQ, kind)
        out_BQHD, _ = attend(q, k, v, q_meta, meta, k_ctx, v_ctx, ctx_meta)
        out_BQD = block.attn.o_proj(out_BQHD.reshape(*out_BQHD.shape[:2], -1))
        x_BQD = x_BQD + conv["attn"].finish(out_BQD, coef)
        h_BQD, coef = conv["mlp"].prepare(block.mlp_norm(x_BQD))
        x_BQD = x_BQD + conv["mlp"].finish(block.mlp(h_BQD), coef)
      return (x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, q_meta, meta, ctx_meta), None

    carry = (x_BQD, ctx_BCD, pos_BQ, ctx_pos_BC, q_meta, meta, ctx_meta)
    xs = () if convs is None else (convs[1],)
    (x_BQD, *_), _ = self.scan_layers(layer, carry, *xs, remat=self.cfg.remat,
                                      layer_weights=layer_weights)
    return self.final_norm(x_BQD)


class DFlash(nnx.Module):
  """The frozen target (a `Transformer`, params `target`) and its drafter (`drafter`)."""

  def __init__(self, target: ModelConfig, drafter: dict, n_features: int, rngs: nnx.Rngs):
    """`drafter`: `drafter_args`' dict."""
    self.target = Transformer(target, rngs)  # params[FROZEN]
    args = dict(drafter, model=ModelConfig(**drafter["model"]))
    self.drafter = Drafter(args.pop("model"), n_features, rngs, **args)  # params[TRAINED]

  @property
  def head(self) -> nnx.Module:
    """The drafter's logits are the target's LM head's."""
    return self.target.head
