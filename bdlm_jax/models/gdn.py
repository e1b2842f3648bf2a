"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3-Next hybrids (docs/gdn.md).

The layer splits as attention does: row-wise work (`project`: the input projections, the
decay g and the write strength beta; `gated_norm`: RMSNormGated; the output projection),
and a sequence mixer over rows that a layout ordered, run by the caller's `recur` (as
`attend` is the caller's): `recur(cell, pre_BRC, g_BRH, beta_BRH, meta) -> o_BRHV` decides
which rows form one causal stream, where each stream starts (its conv context and state),
and calls `cell` on contiguous pieces of it. `Cell` is the sequence math of one piece: the
causal depthwise conv (SiLU) over [q | k | v] from `left` context rows, q and k L2-normed
(q also scaled by K^-1/2), key heads repeated to value heads, and the chunked gated delta
rule (kernels/delta_rule.py) from state `s`.

Packed documents: `starts` marks the rows that start a document. A conv tap never reads a row
before its row's document start, and the state restarts at a document's first row (its decay
set to `RESTART_G`: e^g = 0, the affine map's zero transition), so each document runs as if
alone.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from bdlm_jax.config import ModelConfig
from bdlm_jax.kernels import delta_rule
from bdlm_jax.models.pattern import gdn_shape

L2_EPS = 1e-6  # transformers' (and flash-linear-attention's) l2norm
# The log decay of a row that starts a document: exp underflows to exactly 0 in float32 (the
# state before it is forgotten), and finite, so the chunked kernel's sums stay NaN-free.
RESTART_G = -1e4


def restart(g_BTH, restart_BT):
  """g with the rows that restart the state (bool [B, T]; None: none) at `RESTART_G`."""
  if restart_BT is None:
    return g_BTH
  return jnp.where(restart_BT[..., None], RESTART_G, g_BTH)


def _l2norm(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
  """The sequence math of one layer over consecutive rows of one stream: the causal conv
  (kernel `conv_CK` [C, kernel]) from `left` context rows, then the gated delta rule."""
  conv_CK: jax.Array
  shape: tuple[int, int, int, int]  # (key heads, value heads, key dim, value dim)

  @property
  def halo(self) -> int:
    """Pre-conv rows before a piece that its conv reads."""
    return self.conv_CK.shape[1] - 1

  def _qkv(self, pre_BTC, left_BJC, starts_BJT=None):
    hk, hv, dk, dv = self.shape
    b, t, c = pre_BTC.shape
    if left_BJC is None:
      left_BJC = jnp.zeros((b, self.halo, c), pre_BTC.dtype)
    x = jnp.concatenate([left_BJC.astype(pre_BTC.dtype), pre_BTC], axis=1)
    w = self.conv_CK.astype(x.dtype)
    tap = lambda i: x[:, i:i + t]
    if starts_BJT is not None:  # tap i of row t reads x[t + i]: not across a document start
      n = jnp.cumsum(starts_BJT.astype(jnp.int32), axis=1)  # starts in x[:j + 1]
      tap = lambda i: jnp.where((n[:, i:i + t] == n[:, self.halo:])[..., None], x[:, i:i + t],
                                0)
    conv = sum(tap(i) * w[:, i] for i in range(self.halo + 1))  # depthwise, causal
    conv = jax.nn.silu(conv)
    q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    rep = lambda x: jnp.repeat(x.reshape(b, t, hk, dk), hv // hk, axis=2)
    return _l2norm(rep(q)) * dk ** -0.5, _l2norm(rep(k)), v.reshape(b, t, hv, dv)

  def __call__(self, pre_BTC, left_BJC, g_BTH, beta_BTH, s_BHKV, starts_BJT=None,
               restart_BT=None):
    """(o [B, T, Hv, V] float32, final state [B, Hv, K, V]) of T consecutive rows after
    `left` [B, halo, C] pre-conv rows (None: zeros), from state `s` (None: zeros).

    `starts` bool [B, halo + T]: the rows of [left | rows] that start a document (None: one
    document), which no conv tap reads across; `restart` bool [B, T]: the rows whose state
    restarts (default: `starts`' last T; a caller whose rows include placeholders that must
    leave the state alone passes its own)."""
    q, k, v = self._qkv(pre_BTC, left_BJC, starts_BJT)
    if restart_BT is None and starts_BJT is not None:
      restart_BT = starts_BJT[:, self.halo:]
    if s_BHKV is None:
      _, hv, dk, dv = self.shape
      s_BHKV = jnp.zeros((pre_BTC.shape[0], hv, dk, dv), jnp.float32)
    return delta_rule.chunked(q, k, v, restart(g_BTH, restart_BT), beta_BTH, s_BHKV)

  def transfer(self, pre_BTC, left_BJC, g_BTH, beta_BTH, mn_BHKW, starts_BJT=None,
               restart_BT=None):
    """The rows' effect on the state, which is affine: S_out = M S_in + N, as [N | M]
    [B, Hv, K, V + K], composed after the effect `mn` of the rows before ([0 | I] for none).
    One delta-rule pass with v_aug = [v | 0] from [N | M] ends in the composed [N' | M']
    (M = A_T ... A_1, A_t = e^g_t (I - beta_t k_t k_t^T); N the state from zeros). A restart
    is A_t = 0: nothing of S_in crosses a document start. `starts`, `restart`: `__call__`'s."""
    q, k, v = self._qkv(pre_BTC, left_BJC, starts_BJT)
    if restart_BT is None and starts_BJT is not None:
      restart_BT = starts_BJT[:, self.halo:]
    b, t, hv, _ = v.shape
    v_aug = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((b, t, hv, k.shape[-1]))], -1)
    return delta_rule.chunked(q, k, v_aug, restart(g_BTH, restart_BT), beta_BTH, mn_BHKW)[1]


class GatedDeltaNet(nnx.Module):
  """A Gated DeltaNet layer's weights, named as transformers' `Qwen3_5GatedDeltaNet`'s (the
  conv kernel in its [channels, 1, kernel] layout). `linear(din, dout, cfg, rngs)` builds
  the model's projections."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, linear):
    self.cfg = cfg
    self.shape = gdn_shape(cfg)
    hk, hv, dk, dv = self.shape
    param_dtype = jnp.dtype(cfg.param_dtype)
    channels = 2 * hk * dk + hv * dv
    self.in_proj_qkv = linear(cfg.d_model, channels, cfg, rngs)
    self.in_proj_z = linear(cfg.d_model, hv * dv, cfg, rngs)
    self.in_proj_b = linear(cfg.d_model, hv, cfg, rngs)
    self.in_proj_a = linear(cfg.d_model, hv, cfg, rngs)
    bound = cfg.gdn_conv ** -0.5  # torch's Conv1d init (fan-in = kernel)
    self.conv = nnx.Param(jax.random.uniform(rngs.params(), (channels, 1, cfg.gdn_conv),
                                             param_dtype, -bound, bound))
    self.dt_bias = nnx.Param(jnp.ones((hv,), param_dtype))
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32,
                                                      0.01, 16.0)).astype(param_dtype))
    self.norm = nnx.Param(jnp.ones((dv,), param_dtype))
    self.out_proj = linear(hv * dv, cfg.d_model, cfg, rngs)

  def project(self, h_BRD):
    """(pre-conv [q | k | v] rows [B, R, C], z [B, R, Hv, V], g and beta [B, R, Hv]) of the
    normed rows `h`: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), f32."""
    b, r, _ = h_BRD.shape
    _, hv, _, dv = self.shape
    a = self.in_proj_a(h_BRD).astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a + self.dt_bias[...].astype(jnp.float32))
    beta = jax.nn.sigmoid(self.in_proj_b(h_BRD)).astype(jnp.float32)
    z = self.in_proj_z(h_BRD).reshape(b, r, hv, dv)
    return self.in_proj_qkv(h_BRD), z, g, beta

  def cell(self) -> Cell:
    """The sequence math with this layer's conv kernel and head shapes."""
    return Cell(self.conv[...][:, 0], self.shape)

  def gated_norm(self, o_BRHV, z_BRHV):
    """RMSNormGated: o normed over V in float32, times the weight (in z's dtype), times
    silu(z) in float32, as transformers computes it; [B, R, Hv, V] in z's dtype."""
    dtype = z_BRHV.dtype
    o = o_BRHV.astype(dtype).astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.cfg.norm_eps)
    o = self.norm[...].astype(dtype) * o.astype(dtype)
    return (o * jax.nn.silu(z_BRHV.astype(jnp.float32))).astype(dtype)
