"""Which kind each layer is: the config's repeating periods laid over the model's depth."""

from typing import NamedTuple

import numpy as np

from bdlm_jax.config import ModelConfig
from bdlm_jax.models import rope


def layer_types(m: ModelConfig) -> tuple[str, ...]:
  """The attention type, global or local, of every layer (the last one global with
  `model.last_layer_global`, as Gemma 4 forces it)."""
  period = m.layer_period
  kinds = [period[i % len(period)] for i in range(m.n_layers)]
  if m.last_layer_global and kinds:
    kinds[-1] = "global"
  return tuple(kinds)


def periodic_layers(m: ModelConfig, period: int) -> int:
  """How many leading layers follow the repeating periods exactly, in whole periods of
  `period` layers (a forced last layer may end the run one period early)."""
  kinds, n = layer_types(m), m.n_layers // period * period
  pattern = m.layer_period
  while n and any(kinds[i] != pattern[i % len(pattern)] for i in range(n - period, n)):
    n -= period
  return n


def mlp_types(m: ModelConfig) -> tuple[str, ...]:
  """The MLP kind, dense or moe, of every layer."""
  period = m.mlp_period
  return tuple(period[i % len(period)] for i in range(m.n_layers))


class AttentionShape(NamedTuple):
  """The attention weights' shape of one layer kind."""
  n_kv_heads: int
  head_dim: int
  k_eq_v: bool  # keys and values from one projection


def attention_shape(m: ModelConfig, kind: str) -> AttentionShape:
  """Global layers may have their own head dim, K/V heads and K = V (Gemma 4's)."""
  if kind == "local":
    return AttentionShape(m.n_kv_heads, m.head_dim, False)
  return AttentionShape(m.global_n_kv_heads or m.n_kv_heads, m.global_head_dim or m.head_dim,
                        m.attention_k_eq_v)


def rope_scaling(m: ModelConfig, kind: str) -> str:
  """The RoPE scaling of layers of this kind (local layers': their own, else the model's)."""
  return (m.rope_local_scaling or m.rope_scaling) if kind == "local" else m.rope_scaling


def layer_rope(m: ModelConfig, kind: str, head_dim: int) -> tuple[np.ndarray, float]:
  """(inverse frequencies, factor on cos/sin) of a layer of this kind with this head dim:
  local layers' own base and scaling; the first `partial_rotary_factor` of the head dim
  rotating at frequencies over that part (Qwen3.5, Qwen3-Next); or on global layers only the
  first `global_partial_rotary_factor` of the frequency pairs, each over the whole head dim
  (HF's "proportional" RoPE, Gemma 4)."""
  theta = (m.rope_local_theta or m.rope_theta) if kind == "local" else m.rope_theta
  scaling = rope_scaling(m, kind)
  if kind == "local" or m.global_partial_rotary_factor == 1 or m.partial_rotary_factor < 1:
    return rope.frequencies(scaling, theta, rope.rotary_dim(head_dim, m.partial_rotary_factor))
  inv_freq, attention = rope.frequencies(scaling, theta, head_dim)
  kept = np.arange(head_dim // 2) < int(m.global_partial_rotary_factor * head_dim // 2)
  return np.where(kept, inv_freq, 0.0).astype(np.float32), attention


def gdn_shape(m: ModelConfig) -> tuple[int, int, int, int]:
  """(key heads, value heads, key dim, value dim) of Gated DeltaNet layers (0: n_heads,
  head_dim)."""
  return (m.gdn_key_heads or m.n_heads, m.gdn_value_heads or m.n_heads,
          m.gdn_key_dim or m.head_dim, m.gdn_value_dim or m.head_dim)


def split_attention(m: ModelConfig) -> bool:
  """Whether local and global layers have weights of different shapes (so separate stacks)."""
  kinds = set(layer_types(m)) - {"gdn"}  # Gated DeltaNet layers always have their own
  return len(kinds) == 2 and attention_shape(m, "local") != attention_shape(m, "global")
