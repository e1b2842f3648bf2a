"""Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE/Mistral/Gemma 3 <-> bdlm_jax: tensor names and model
config fields (Gemma 4 and DiffusionGemma: hf_gemma4.py; Qwen3.5 and Qwen3-Next: hf_qwen3_5.py).

The one place that knows both vocabularies; import (hf_import.py) and export (hf_export.py)
read the same tables in opposite directions. Llama and Qwen3 match our decoder exactly:
pre-norm, RMSNorm in float32 with a multiplicative weight, SwiGLU MLP, grouped-query attention
without biases, half-split ("rotate_half") RoPE, and for Qwen3 an RMSNorm on q and k per head
before RoPE. Qwen2 (`qwen2`, Qwen2.5) is Llama with biases on q, k and v (`qkv_bias`);
Mistral (`mistral`) is Llama whose every layer sees a sliding window where `sliding_window`
is set. Their RoPE scaling (`rope_parameters`, 4.x's `rope_scaling`) is `model.rope_scaling`
(hf_tensor.rope_from_hf). Qwen3-MoE (`qwen3_moe`) is Qwen3 with our `MoE` as every layer's
MLP: a router without bias, no shared expert, and each expert's SwiGLU saved as its own
three tensors. Gemma 3 (`gemma3_text`, text only) is Qwen3 plus what `ModelConfig` has fields
for: norms on the attention and MLP outputs, embeddings times sqrt(d_model), GeGLU, its own
attention scale, a final logit soft cap and sliding-window layers. Its RMSNorms multiply by
(1 + w) in float32, so our `scale` is HF's w + 1, added in float32 as HF does. HF `nn.Linear`
weights are [out, in]; our flax kernels are [in, out].
"""

from __future__ import annotations

from bdlm_jax.checkpoint import hf_gemma4, hf_qwen3_5
from bdlm_jax.checkpoint.hf_tensor import (ACTIVATIONS, LAYER_TYPES, Tensor, max_positions_of,
                                           mlp_pattern, require, rope_from_hf, rope_to_hf,
                                           shared_config, shortest_period, sparse_config)
from bdlm_jax.config import ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.pattern import layer_types, mlp_types, rope_scaling
from bdlm_jax.models.transformer import layer_slots

GEMMA3 = "gemma3_text"
QWEN3_MOE = "qwen3_moe"
QWEN2 = "qwen2"  # Qwen2, Qwen2.5: Llama with biases on q, k and v
MISTRAL = "mistral"  # Llama with a sliding window on every layer where one is set
GEMMA4_TYPES = ("gemma4_text", "diffusion_gemma")  # hf_gemma4.py
MODEL_TYPES = ("llama", "qwen3", QWEN3_MOE, QWEN2, MISTRAL, GEMMA3, *GEMMA4_TYPES,
               *hf_qwen3_5.MODEL_TYPES)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 QWEN3_MOE: "Qwen3MoeForCausalLM", GEMMA3: "Gemma3ForCausalLM",
                 QWEN2: "Qwen2ForCausalLM", MISTRAL: "MistralForCausalLM"}
# Tensors an HF folder may hold that carry nothing we need (old Llama checkpoints keep the
# RoPE frequencies as a buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# ModelConfig field <- config.json key, for the fields that fix parameter shapes (of a dense
# model; see `shape_fields`).
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

_LINEARS = {  # HF name inside `model.layers.{i}.` -> our path inside `layers` (transposed)
    "self_attn.q_proj.weight": ("attn", "q_proj", "kernel"),
    "self_attn.k_proj.weight": ("attn", "k_proj", "kernel"),
    "self_attn.v_proj.weight": ("attn", "v_proj", "kernel"),
    "self_attn.o_proj.weight": ("attn", "o_proj", "kernel"),
}
_DENSE_MLP = {"mlp.gate_proj.weight": ("mlp", "gate_proj", "kernel"),
              "mlp.up_proj.weight": ("mlp", "up_proj", "kernel"),
              "mlp.down_proj.weight": ("mlp", "down_proj", "kernel")}
_ROUTER = {"mlp.gate.weight": ("mlp", "router", "kernel")}  # HF [E, D], ours [D, E]
# HF name inside `model.layers.{i}.mlp.experts.{e}.` -> our [L, E, ...] array in `layers`: HF
# [out, in] per expert, ours [in, out] (gate/up [D, F], down [F, D]).
_EXPERTS = {f"{proj}.weight": ("mlp", proj) for proj in ("gate_proj", "up_proj", "down_proj")}
# Per model type, HF layer norm -> ours. The same HF name means different norms: Llama's
# "post_attention_layernorm" is the norm before the MLP, Gemma's the one on the attention output.
_LLAMA_NORMS = {"input_layernorm.weight": ("attn_norm",),
                "post_attention_layernorm.weight": ("mlp_norm",)}
_NORMS = {"llama": _LLAMA_NORMS, "qwen3": _LLAMA_NORMS, QWEN3_MOE: _LLAMA_NORMS,
          QWEN2: _LLAMA_NORMS, MISTRAL: _LLAMA_NORMS, GEMMA3: {
    "input_layernorm.weight": ("attn_norm",),
    "post_attention_layernorm.weight": ("post_attn_norm",),
    "pre_feedforward_layernorm.weight": ("mlp_norm",),
    "post_feedforward_layernorm.weight": ("post_mlp_norm",),
}}
_QK_NORMS = {"self_attn.q_norm.weight": ("attn", "q_norm"),
             "self_attn.k_norm.weight": ("attn", "k_norm")}
PLAIN = '{"rope_type": "default"}'  # local layers' plain RoPE beside scaled global layers
_QKV_BIASES = {f"self_attn.{p}.bias": ("attn", p, "bias") for p in ("q_proj", "k_proj", "v_proj")}
# Gemma3TextConfig's defaults, for keys a hand-written config.json may leave out.
_GEMMA3_DEFAULTS = dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", rope_theta=1e6,
                        rope_local_base_freq=1e4, query_pre_attn_scalar=256, sliding_window=4096,
                        sliding_window_pattern=6, tie_word_embeddings=True)
# Qwen3MoeConfig's defaults, likewise.
_QWEN3_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           norm_topk_prob=False, router_aux_loss_coef=0.001,
                           decoder_sparse_step=1, mlp_only_layers=[])


def hf_model_type(m: ModelConfig, like: str | None = None) -> str:
  """The HF family that expresses `m`: Gemma 4 or DiffusionGemma when it has their features
  (`hf_gemma4.model_type`), Gemma 3 when it has Gemma's norms and embedding scale, else
  Qwen3-MoE (experts), Qwen3 (q/k norms) or Llama; Qwen3.5 or Qwen3-Next (hf_qwen3_5.py)
  with Gated DeltaNet layers or gated attention, `like` (the model_type of the folder `m`
  came from) choosing where both express it; a ConfigError when no family fits."""
  gemma4 = any(getattr(m, k) for k in hf_gemma4.FEATURES) or m.global_partial_rotary_factor != 1
  if (m.rope_scaling or m.rope_local_scaling) and (gemma4 or hf_qwen3_5.owns(m)):
    raise ConfigError("model.rope_scaling is exported for Llama, Qwen2, Qwen3, Qwen3-MoE, "
                      "Mistral and Gemma 3; the Gemma 4 and Qwen3.5 families keep plain RoPE")
  if hf_qwen3_5.owns(m):
    return hf_qwen3_5.model_type(m, like)
  if gemma4:
    return hf_gemma4.model_type(m)
  gemma = ("post_norms", "scale_embeddings", "qk_norm")
  if m.moe_experts and (m.post_norms or m.scale_embeddings or not m.qk_norm):
    raise ConfigError(
        f"no Hugging Face family expresses this model: its experts (model.moe_experts="
        f"{m.moe_experts}) need Qwen3-MoE, which has q/k norms and no Gemma 3 features: set "
        f"model.qk_norm=true, model.post_norms=false, model.scale_embeddings=false")
  if m.post_norms or m.scale_embeddings:
    missing = [f"model.{k}" for k in gemma if not getattr(m, k)]
    if missing:
      raise ConfigError(f"no Hugging Face family expresses this model: it has Gemma 3 features, "
                        f"but Gemma 3 also needs {', '.join(missing)}=true")
    return GEMMA3
  kinds = set(layer_types(m))
  if m.qkv_bias and (m.moe_experts or m.qk_norm or kinds != {"global"}):
    raise ConfigError(f"no Hugging Face family expresses this model: its q/k/v biases "
                      f"(model.qkv_bias) need Qwen2, which has no experts, no q/k norms and "
                      f"no sliding-window layers (model.moe_experts={m.moe_experts}, "
                      f"model.qk_norm={m.qk_norm}, model.layer_pattern={m.layer_pattern!r})")
  mistral = kinds == {"local"} and not (m.qk_norm or m.moe_experts)
  not_llama = [f"model.{k}={getattr(m, k)!r}" for k, fits in (
      ("layer_pattern", "local" not in kinds or mistral),
      ("mlp_activation", m.mlp_activation == "silu"),
      ("query_pre_attn_scalar", m.query_pre_attn_scalar in (0, m.head_dim)),
      ("logit_softcap", m.logit_softcap == 0)) if not fits]
  if not_llama and m.moe_experts:
    raise ConfigError(f"no Hugging Face family expresses this model: its experts need "
                      f"Qwen3-MoE, which cannot have {', '.join(not_llama)}")
  if not_llama:
    raise ConfigError(f"no Hugging Face family expresses this model: Llama, Qwen2, Qwen3 and "
                      f"Mistral (every layer local) cannot have {', '.join(not_llama)}, and "
                      f"Gemma 3 needs {', '.join(f'model.{k}' for k in gemma)} all true")
  if m.moe_experts:
    return QWEN3_MOE
  if m.qkv_bias:
    return QWEN2
  return MISTRAL if mistral else "qwen3" if m.qk_norm else "llama"


def tensor_map(m: ModelConfig, like: str | None = None) -> list[Tensor]:
  """Every HF tensor of `m` (in the family `hf_model_type(m, like)`), with where it lives in
  our params pytree."""
  model_type = hf_model_type(m, like)
  if model_type in GEMMA4_TYPES:
    return hf_gemma4.tensor_map(m, model_type)
  if model_type in hf_qwen3_5.MODEL_TYPES:
    return hf_qwen3_5.tensor_map(m, model_type)
  offset = 1.0 if model_type == GEMMA3 else 0.0
  norms = {**_NORMS[model_type], **(_QK_NORMS if m.qk_norm else {})}
  per_layer = [(name, (*path, "scale"), False, offset) for name, path in norms.items()]
  per_layer += [(name, path, True, 0.0) for name, path in _LINEARS.items()]
  biases = _QKV_BIASES if m.qkv_bias else {}
  per_layer += [(name, path, False, 0.0) for name, path in biases.items()]
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), False, None)]
  for i, ((stack, j), kind) in enumerate(zip(layer_slots(m), mlp_types(m))):
    mlp = [(name, path, True, 0.0)
           for name, path in (_ROUTER if kind == "moe" else _DENSE_MLP).items()]
    out += [Tensor(f"model.layers.{i}.{name}", (stack, *path), t, j, off)
            for name, path, t, off in per_layer + mlp]
    if kind == "moe":
      out += [Tensor(f"model.layers.{i}.mlp.experts.{e}.{name}", (stack, *path), True, j,
                     expert=e) for e in range(m.moe_experts) for name, path in _EXPERTS.items()]
  out.append(Tensor("model.norm.weight", ("final_norm", "scale"), False, None, offset))
  if not m.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), True, None))
  return out


def shape_fields(m: ModelConfig) -> dict:
  """The ModelConfig fields that fix the params' shapes: with experts, their width
  (moe_d_ff, 0 meaning d_ff) and which layers have them; d_ff only if some layer is dense."""
  out = {k: getattr(m, k) for k in (*SHAPE_KEYS, "qk_norm", "qkv_bias", "post_norms", "moe_experts",
                                    "global_head_dim", "global_n_kv_heads", "attention_k_eq_v",
                                    "moe_beside_dense", "moe_router_norm", "layer_scalar",
                                    "self_conditioning", "attention_gate", "gdn_key_heads",
                                    "gdn_value_heads", "gdn_key_dim", "gdn_value_dim",
                                    "gdn_conv")}
  out["gdn_layers"] = tuple(k == "gdn" for k in layer_types(m))  # their weights differ
  if m.moe_experts:
    out["moe_d_ff"] = m.moe_d_ff or m.d_ff
    out["mlp_types"] = mlp_types(m)
    if "dense" not in out["mlp_types"]:
      del out["d_ff"]
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
  """ModelConfig fields from an HF config.json dict; unsupported variants raise ConfigError.
  A verifier's `output_multiplier` (its head's logits times it before the soft cap, as the
  seed reads it: core/models/backbones/nemotron/model.py ~4697-4710) is kept in every family."""
  fields = _family_fields(hf, where)
  multiplier = hf.get("output_multiplier")
  if multiplier is not None:
    if not float(multiplier) > 0:
      raise ConfigError(f"{where}: output_multiplier={multiplier!r} must be > 0")
    fields["output_multiplier"] = float(multiplier)
  return fields


def _family_fields(hf: dict, where: str) -> dict:
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"{where}: model_type={model_type!r} is not supported; bdlm_jax imports "
                      f"{list(MODEL_TYPES)}")
  if model_type in GEMMA4_TYPES:
    return hf_gemma4.model_fields(hf, where)
  if model_type in hf_qwen3_5.MODEL_TYPES:
    return hf_qwen3_5.model_fields(hf, where)
  if model_type != QWEN2:  # Qwen2's q, k and v always have biases, its o_proj none
    require(hf, where, "attention_bias", (False,), "attention projections have no bias")
  n_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      d_ff=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
  if model_type == GEMMA3:
    return {**fields, **_gemma3_fields(hf, where)}
  require(hf, where, "hidden_act", ("silu",), "the MLP is SwiGLU")
  require(hf, where, "mlp_bias", (False,), "MLP projections have no bias")
  require(hf, where, "use_sliding_window", (False,), "every layer attends to the full context")
  window = hf.get("sliding_window") if model_type == MISTRAL else None
  if model_type != MISTRAL and any(t != "full_attention" for t in hf.get("layer_types") or ()):
    raise ConfigError(f"{where}: layer_types={hf['layer_types']} has sliding-window layers; "
                      f"bdlm_jax imports them from Gemma 3 and Mistral only")
  params, key = ((hf["rope_parameters"], "rope_parameters") if hf.get("rope_parameters") else
                 (hf.get("rope_scaling") or {}, "rope_scaling"))
  theta, scaling = rope_from_hf(params, hf, key, where, hf.get("rope_theta", 10000.0), head_dim)
  if model_type == QWEN3_MOE:
    fields.update(_qwen3_moe_fields(hf, where))
  if window:
    fields.update(layer_pattern="local", sliding_window=int(window))
  return dict(
      fields, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
      qk_norm=model_type in ("qwen3", QWEN3_MOE), qkv_bias=model_type == QWEN2,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _qwen3_moe_fields(hf: dict, where: str) -> dict:
  """The expert fields of a Qwen3-MoE config.json (a key left out or null takes
  Qwen3MoeConfig's default). The expert count is `num_experts` in Qwen's files and
  `num_local_experts` in those transformers 5 writes. Layer i is MoE unless it is in
  `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, as in HF; the
  layers' kinds become `mlp_pattern` (their shortest period). No experts: a dense model."""
  experts = next((hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None),
                 _QWEN3_MOE_DEFAULTS["num_experts"])
  if not experts:
    return {}  # every layer's MLP is dense, with the tensor names of Qwen3's
  hf = {**_QWEN3_MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  pattern = mlp_pattern(hf, where)
  if pattern is None:
    return {}
  return dict(mlp_pattern=pattern, moe_experts=int(experts),
              moe_top_k=int(hf["num_experts_per_tok"]), moe_d_ff=int(hf["moe_intermediate_size"]),
              moe_norm_topk=bool(hf["norm_topk_prob"]),
              moe_aux_weight=float(hf["router_aux_loss_coef"]))


def _gemma3_fields(hf: dict, where: str) -> dict:
  """The fields a Gemma 3 config.json sets beyond the shared ones (a key left out or null
  takes Gemma3TextConfig's default)."""
  hf = {**_GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  require(hf, where, "hidden_activation", tuple(ACTIVATIONS), "the MLP is GeGLU or SwiGLU")
  require(hf, where, "use_bidirectional_attention", (False,), "attention is causal")
  if hf.get("attn_logit_softcapping") is not None:
    raise ConfigError(f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not "
                      f"supported (bdlm_jax's attention kernels do not soft-cap attention "
                      f"logits); bdlm_jax needs attn_logit_softcapping null")
  n_layers = hf["num_hidden_layers"]
  every = hf["sliding_window_pattern"]  # the layer_types of configs from before layer_types
  hf_types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else
                                       "sliding_attention" for i in range(n_layers)]
  unknown = sorted(set(hf_types) - set(LAYER_TYPES))
  if unknown:
    raise ConfigError(f"{where}: layer_types has the unsupported type(s) {unknown}; bdlm_jax "
                      f"knows {list(LAYER_TYPES)}")
  if len(hf_types) != n_layers:
    raise ConfigError(f"{where}: layer_types has {len(hf_types)} entries for "
                      f"num_hidden_layers={n_layers}")
  types = [LAYER_TYPES[t] for t in hf_types]
  has_local = "local" in types
  rope = hf.get("rope_parameters") or {}
  if "full_attention" in rope or "sliding_attention" in rope:  # transformers >= 5
    full, full_key = rope.get("full_attention") or {}, "rope_parameters.full_attention"
    local, local_key = rope.get("sliding_attention") or {}, "rope_parameters.sliding_attention"
  else:  # transformers 4.x: rope_scaling for the global layers; local ones are plain
    full = rope or hf.get("rope_scaling") or {}
    full_key = "rope_parameters" if rope else "rope_scaling"
    local, local_key = {}, "rope_local_base_freq"
  theta, scaling = rope_from_hf(full, hf, full_key, where, hf["rope_theta"], hf["head_dim"])
  local_theta, local_scaling = rope_from_hf(local, hf, local_key, where,
                                            hf["rope_local_base_freq"], hf["head_dim"])
  return dict(
      head_dim=hf["head_dim"], qk_norm=True, post_norms=True, scale_embeddings=True,
      layer_pattern=",".join(shortest_period(types)),
      sliding_window=int(hf["sliding_window"]) if has_local else 0,
      rope_theta=theta, rope_scaling=scaling,
      rope_local_theta=local_theta if has_local else 0.0,
      rope_local_scaling=(local_scaling or PLAIN) if has_local and local_scaling != scaling else "",
      query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]),
      mlp_activation=ACTIVATIONS[hf["hidden_activation"]],
      logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
      tie_embeddings=bool(hf["tie_word_embeddings"]))


def hf_config(m: ModelConfig, dtype: str, max_positions: int, extra: dict,
              vision: dict | None = None, like: str | None = None) -> dict:
  """config.json for `m` that transformers loads as its family (`hf_model_type(m, like)`;
  `vision`: a DiffusionGemma's vision_config)."""
  model_type = hf_model_type(m, like)
  if model_type in GEMMA4_TYPES:
    return hf_gemma4.hf_config(m, model_type, dtype, max_positions, extra, vision)
  if model_type in hf_qwen3_5.MODEL_TYPES:
    return hf_qwen3_5.hf_config(m, model_type, dtype, max_positions, extra)
  max_positions = max_positions_of(m.rope_scaling, max_positions)
  out = {
      "architectures": [ARCHITECTURES[model_type]],
      "model_type": model_type,
      **shared_config(m, max_positions),
      "dtype": dtype,
  }
  if model_type == GEMMA3:
    out.update(_gemma3_config(m, max_positions))
  else:
    rope = rope_to_hf(m.rope_scaling, m.rope_theta)
    out.update({
        "hidden_act": "silu",
        # Both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta and
        # rope_scaling.
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
        **({"rope_scaling": rope} if m.rope_scaling else {}),
        "mlp_bias": False,
    })
  if model_type in ("qwen3", QWEN3_MOE, QWEN2):
    out["use_sliding_window"] = False
  if model_type == MISTRAL:
    out["sliding_window"] = m.sliding_window
  if model_type == QWEN3_MOE:
    out.update({
        "num_experts": m.moe_experts,
        "num_experts_per_tok": m.moe_top_k,
        "moe_intermediate_size": m.moe_d_ff or m.d_ff,
        "norm_topk_prob": m.moe_norm_topk,
        "router_aux_loss_coef": m.moe_aux_weight,
        **sparse_config(mlp_types(m)),
        "output_router_logits": False,  # as Qwen's files: HF's forward adds no aux loss
    })
  return {**out, **extra}


def _gemma3_config(m: ModelConfig, max_positions: int) -> dict:
  """Gemma 3's own config.json keys, readable by transformers 5 (`layer_types`,
  `rope_parameters` per layer type) and 4.x (`sliding_window_pattern`, `rope_theta`,
  `rope_local_base_freq`; a 4.x release that predates `layer_types` reads only a pattern of
  local layers closed by one global layer correctly)."""
  kinds = layer_types(m)
  period = len(m.layer_period)
  local_theta = m.rope_local_theta or m.rope_theta
  out = {
      "hidden_activation": {ours: hf for hf, ours in ACTIVATIONS.items()}[m.mlp_activation],
      "layer_types": [{ours: hf for hf, ours in LAYER_TYPES.items()}[k] for k in kinds],
      # Unused without local layers, but transformers builds their mask anyway.
      "sliding_window": m.sliding_window or max_positions,
      "rope_theta": m.rope_theta,
      "rope_local_base_freq": local_theta,
      "rope_parameters": {
          "full_attention": rope_to_hf(m.rope_scaling, m.rope_theta),
          "sliding_attention": rope_to_hf(rope_scaling(m, "local"), local_theta)},
      "query_pre_attn_scalar": m.query_pre_attn_scalar or m.head_dim,
      "final_logit_softcapping": m.logit_softcap or None,
      "attn_logit_softcapping": None,
      "use_bidirectional_attention": False,
  }
  if kinds[:period] == ("local",) * (period - 1) + ("global",):
    out["sliding_window_pattern"] = period  # the one pattern transformers 4.x's int expresses
  return out
