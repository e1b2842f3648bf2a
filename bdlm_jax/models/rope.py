"""Rotary position embedding and its scalings, in transformers' vocabulary.

A layer's RoPE is its base (`model.rope_theta`), its rotary dim and its scaling: a JSON
object of transformers' `rope_parameters` keys (`model.rope_scaling`, e.g.
'{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
"original_max_position_embeddings": 8192}'; "" is plain RoPE). `frequencies` computes the
inverse frequencies and the factor on cos/sin as transformers 5's `modeling_rope_utils`
does, in float32, once per layer kind (NumPy constants of the trace).

transformers recomputes `dynamic` and `longrope` frequencies from each forward's longest
position. Here they are fixed at the scaling's `seq_len` (its length, set to the run's
`data.seq_len`: load checks they agree), for training, evaluation and sampling alike, so a
model samples with the frequencies it trained with and its logits equal transformers' for a
forward of `seq_len` tokens. `dynamic` also needs `max_position_embeddings`, the length its
scaling starts from (config.json's key, kept in the scaling).
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.errors import ConfigError

# rope_type -> (keys it needs, keys it may have), as transformers 5 validates them, plus the
# lengths this package fixes length-dependent types at.
_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "max_position_embeddings", "seq_len"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
    "longrope": (("factor", "original_max_position_embeddings", "long_factor", "short_factor",
                  "seq_len"), ("attention_factor",)),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor"), ()),
}
ROPE_TYPES = tuple(_KEYS)
LENGTH_DEPENDENT = ("dynamic", "longrope")  # fixed at the scaling's `seq_len`


def parse(text: str, key: str = "model.rope_scaling") -> dict:
  """The scaling object of a `model.rope_scaling` string ({} for "": plain RoPE)."""
  if not text.strip():
    return {}
  try:
    scaling = json.loads(text)
  except json.JSONDecodeError:
    scaling = None
  if not isinstance(scaling, dict):
    raise ConfigError(f"{key}={text!r} is not a JSON object of transformers' rope_parameters "
                      f"keys, e.g. '{{\"rope_type\": \"linear\", \"factor\": 4}}'")
  return scaling


def check(key: str, text: str, rotary_dim: int) -> None:
  """A clear ConfigError for a scaling transformers would refuse or compute wrongly."""
  scaling = parse(text, key)
  kind = scaling.get("rope_type", "default")
  if kind not in _KEYS:
    raise ConfigError(f"{key} has rope_type={kind!r}; bdlm_jax implements {list(ROPE_TYPES)}")
  need, may = _KEYS[kind]
  missing = [k for k in need if scaling.get(k) is None]
  if missing:
    raise ConfigError(f"{key} (rope_type {kind!r}) needs {', '.join(missing)}")
  unknown = sorted(set(scaling) - {"rope_type", *need, *may})
  if unknown:
    where = ("model.rope_theta / model.partial_rotary_factor set them"
             if set(unknown) & {"rope_theta", "partial_rotary_factor"} else
             f"rope_type {kind!r} takes {sorted({'rope_type', *need, *may})}")
    raise ConfigError(f"{key} has the keys {unknown}, which it does not take: {where}")
  for k in ("factor", "original_max_position_embeddings", "max_position_embeddings",
            "seq_len", "attention_factor"):
    if k in scaling and not (isinstance(scaling[k], (int, float)) and scaling[k] > 0):
      raise ConfigError(f"{key} has {k}={scaling[k]!r}; it must be a number > 0")
  if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
    raise ConfigError(f"{key} has high_freq_factor={scaling['high_freq_factor']} <= "
                      f"low_freq_factor={scaling['low_freq_factor']}; llama3 needs it larger")
  if kind == "dynamic" and rotary_dim <= 2:
    raise ConfigError(f"{key}: dynamic RoPE needs a rotary dim > 2, got {rotary_dim}")
  if kind == "longrope":
    for k in ("long_factor", "short_factor"):
      if len(scaling[k]) != rotary_dim // 2:
        raise ConfigError(f"{key} has {len(scaling[k])} {k} values; the rotary dim "
                          f"{rotary_dim} has {rotary_dim // 2} frequency pairs")


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
  """The dims that rotate, int(head_dim * factor) as transformers takes them."""
  return int(head_dim * partial_rotary_factor)


@functools.lru_cache(maxsize=None)
def frequencies(text: str, theta: float, dim: int) -> tuple[np.ndarray, float]:
  """(inverse frequencies [dim // 2] float32, factor on cos and sin) of a rotary dim `dim`
  with base `theta` and the scaling `text`, as transformers computes them."""
  s = parse(text)
  kind = s.get("rope_type", "default")
  exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  plain = (1.0 / np.float32(theta) ** exponent).astype(np.float32)
  if kind == "default":
    return plain, 1.0
  if kind == "linear":
    return plain / np.float32(s["factor"]), 1.0
  if kind == "dynamic":
    factor, trained = s["factor"], s["max_position_embeddings"]
    length = max(s["seq_len"], trained)
    base = theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
    return (1.0 / np.float32(base) ** exponent).astype(np.float32), 1.0
  if kind == "llama3":
    return _llama3(plain, s), 1.0
  if kind == "yarn":
    return _yarn(s, theta, dim, exponent)
  factor, original = s["factor"], s["original_max_position_embeddings"]  # longrope
  ext = np.asarray(s["long_factor"] if s["seq_len"] > original else s["short_factor"],
                   np.float32)
  attention = s.get("attention_factor")
  if attention is None:
    attention = (1.0 if factor <= 1 else
                 math.sqrt(1 + math.log(factor) / math.log(original)))
  return (1.0 / (ext * np.float32(theta) ** exponent)).astype(np.float32), float(attention)


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
  """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth ramp
  between."""
  factor, old = s["factor"], s["original_max_position_embeddings"]
  low, high = s["low_freq_factor"], s["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old / low, inv_freq / np.float32(factor), inv_freq)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(s: dict, theta: float, dim: int, exponent: np.ndarray) -> tuple[np.ndarray, float]:
  """YaRN: interpolated (divided by `factor`) below a band of dims, extrapolated above it, a
  linear ramp across it; cos and sin times its attention factor (mscale)."""
  factor, original = s["factor"], s["original_max_position_embeddings"]

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = s.get("attention_factor")
  if attention is None:
    attention = (mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
                 if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))
  beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

  def correction_dim(rotations):
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if s.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolated = (1 - ramp).astype(np.float32)
  pos_freqs = np.float32(theta) ** exponent
  inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
  return inv_freq.astype(np.float32), float(attention)


def rope(x_BRHD: jax.Array, pos_BR: jax.Array, inv_freq_F: np.ndarray,
         attention_factor: float = 1.0) -> jax.Array:
  """Rotary embedding, half-split convention (Hugging Face's rotate_half), over the first
  2F dims of x's head dim at the F inverse frequencies; the rest of the head passes
  unchanged. cos and sin carry the scaling's attention factor (YaRN, LongRoPE)."""
  rot = 2 * inv_freq_F.shape[0]
  angle_BRF = pos_BR[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_F)
  cos = (jnp.cos(angle_BRF) * attention_factor)[:, :, None, :]
  sin = (jnp.sin(angle_BRF) * attention_factor)[:, :, None, :]
  x1, x2 = jnp.split(x_BRHD[..., :rot].astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BRHD.dtype)
  return out if rot == x_BRHD.shape[-1] else jnp.concatenate([out, x_BRHD[..., rot:]], -1)


def dump(scaling: dict) -> str:
  """The `model.rope_scaling` string of a scaling object ("" for plain RoPE)."""
  if scaling.get("rope_type", "default") == "default":
    return ""
  return json.dumps(scaling, sort_keys=True)


def at_length(text: str, seq_len: int) -> str:
  """`text` with a length-dependent scaling fixed at `seq_len` (others unchanged)."""
  scaling = parse(text)
  if scaling.get("rope_type") not in LENGTH_DEPENDENT:
    return text
  return dump({**scaling, "seq_len": int(seq_len)})


def check_config(m, seq_len: int) -> None:
  """The RoPE scalings of a ModelConfig `m` (bdlm_jax.config), the model trained on
  sequences of `seq_len` tokens."""
  if m.rope_scaling and m.global_partial_rotary_factor != 1:
    raise ConfigError("model.rope_scaling with model.global_partial_rotary_factor < 1 "
                      "(Gemma 4's proportional RoPE) is not implemented")
  dim = rotary_dim(m.head_dim, m.partial_rotary_factor)
  for key in ("rope_scaling", "rope_local_scaling"):
    check(f"model.{key}", getattr(m, key), dim)
    _check_length(f"model.{key}", getattr(m, key), seq_len)


def _check_length(key: str, text: str, seq_len: int) -> None:
  """A length-dependent scaling is fixed at the length the run trains at."""
  scaling = parse(text)
  if scaling.get("rope_type") in LENGTH_DEPENDENT and scaling["seq_len"] != seq_len:
    raise ConfigError(f"{key} has rope_type {scaling['rope_type']!r} fixed at seq_len="
                      f"{scaling['seq_len']}, but data.seq_len={seq_len}: bdlm_jax computes its "
                      f"frequencies at the trained length, so set its seq_len to {seq_len}")
