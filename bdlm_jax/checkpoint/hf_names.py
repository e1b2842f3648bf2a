"""Hugging Face Llama/Qwen3 <-> bdlm_jax: tensor names and model config fields.

The one place that knows both vocabularies; import (hf_import.py) and export (hf_export.py)
read the same tables in opposite directions. The architectures match exactly: pre-norm
decoder, RMSNorm in float32 with a multiplicative weight, SwiGLU MLP, grouped-query attention
without biases, half-split ("rotate_half") RoPE, and for Qwen3 an RMSNorm on q and k per head
before RoPE. HF `nn.Linear` weights are [out, in]; our flax kernels are [in, out].
"""

from __future__ import annotations

from typing import NamedTuple

from bdlm_jax.config import ConfigError, ModelConfig

MODEL_TYPES = ("llama", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensors an HF folder may hold that carry nothing we need (old Llama checkpoints keep the
# RoPE frequencies as a buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# ModelConfig field <- config.json key, for the fields that fix parameter shapes.
SHAPE_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "tie_embeddings": "tie_word_embeddings",
}

_LAYER = {  # HF name inside `model.layers.{i}.` -> (our path inside `layers`, transposed)
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "self_attn.q_proj.weight": (("attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("attn", "o_proj", "kernel"), True),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
}
_QK_NORM = {
    "self_attn.q_norm.weight": (("attn", "q_norm", "scale"), False),
    "self_attn.k_norm.weight": (("attn", "k_norm", "scale"), False),
}


class Tensor(NamedTuple):
  """Where one HF tensor lives in our params pytree.

  Layer weights are stacked (`layers` holds one array per weight with a leading layer
  axis), so HF's `model.layers.{i}.X` is slice `layer` = i of the array at `path`.
  """

  name: str  # HF tensor name
  path: tuple  # keys into our params pytree
  transposed: bool  # HF nn.Linear [out, in] vs our kernel [in, out]
  layer: int | None  # index on the stacked layer axis, None for unstacked weights


def tensor_map(m: ModelConfig) -> list[Tensor]:
  """Every HF tensor of `m`, with where it lives in our params pytree."""
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), False, None)]
  per_layer = {**_LAYER, **(_QK_NORM if m.qk_norm else {})}
  for i in range(m.n_layers):
    out += [Tensor(f"model.layers.{i}.{name}", ("layers", *path), t, i)
            for name, (path, t) in per_layer.items()]
  out.append(Tensor("model.norm.weight", ("final_norm", "scale"), False, None))
  if not m.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), True, None))
  return out


def get_path(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def set_path(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def model_config_from_hf(hf: dict, where: str) -> dict:
  """ModelConfig fields from an HF config.json dict; unsupported variants raise ConfigError."""
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"{where}: model_type={model_type!r} is not supported; bdlm_jax imports "
                      f"{list(MODEL_TYPES)}")

  def require(key, allowed, what):
    if hf.get(key, allowed[0]) not in allowed:
      raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({what}); bdlm_jax "
                        f"needs {key} in {allowed}")

  require("hidden_act", ("silu",), "the MLP is SwiGLU")
  require("attention_bias", (False,), "attention projections have no bias")
  require("mlp_bias", (False,), "MLP projections have no bias")
  require("use_sliding_window", (False,), "every layer attends to the full context")
  if any(t != "full_attention" for t in hf.get("layer_types") or ()):
    raise ConfigError(f"{where}: layer_types={hf['layer_types']} has sliding-window layers; "
                      f"bdlm_jax supports only 'full_attention'")
  n_heads = hf["num_attention_heads"]
  return dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      d_ff=hf["intermediate_size"], rope_theta=float(_rope_theta(hf, where)),
      qk_norm=model_type == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def _rope_theta(hf: dict, where: str) -> float:
  """Plain RoPE only: transformers 5 writes `rope_parameters`, older files `rope_scaling`."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default" or params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError(f"{where}: RoPE scaling {params} is not supported; bdlm_jax implements "
                      f"plain RoPE (rope_scaling null / rope_type 'default') only")
  return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def hf_config(m: ModelConfig, dtype: str, max_positions: int, extra: dict) -> dict:
  """config.json for `m` that transformers loads as Llama (or Qwen3 when m.qk_norm)."""
  model_type = "qwen3" if m.qk_norm else "llama"
  out = {
      "architectures": [ARCHITECTURES[model_type]],
      "model_type": model_type,
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "num_hidden_layers": m.n_layers,
      "num_attention_heads": m.n_heads,
      "num_key_value_heads": m.n_kv_heads,
      "head_dim": m.head_dim,
      "intermediate_size": m.d_ff,
      "hidden_act": "silu",
      "rms_norm_eps": m.norm_eps,
      # Both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta.
      "rope_theta": m.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
      "attention_bias": False,
      "mlp_bias": False,
      "tie_word_embeddings": m.tie_embeddings,
      "max_position_embeddings": max_positions,
      "dtype": dtype,
  }
  if model_type == "qwen3":
    out["use_sliding_window"] = False
  return {**out, **extra}
