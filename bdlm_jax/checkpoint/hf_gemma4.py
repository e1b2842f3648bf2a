"""Hugging Face Gemma 4 (`gemma4_text`) and DiffusionGemma (`diffusion_gemma`, its text
model) <-> bdlm_jax: tensor names and config fields (docs/gemma4.md).

Gemma 4 is Gemma 3 plus what `ModelConfig`'s Gemma 4 fields say: global layers with their
own head dim and K/V heads (`per_layer_config`), K = V on them (`attention_k_eq_v`), RoPE
per layer type with "proportional" partial rotation on global layers, a weightless norm on
the values, attention logits unscaled (`query_pre_attn_scalar` 1), norms that multiply by w
(not Gemma 3's 1 + w), a per-layer `layer_scalar` buffer, and with `enable_moe_block` a
dense MLP beside routed experts in every layer. HF stores each layer's experts as
`experts.gate_up_proj` [E, 2F, D] (gate rows first) and `experts.down_proj` [E, D, F].

DiffusionGemma's text model is that model with experts in every layer and K = V always; its
weights live under `model.decoder.` (the encoder's are tied to them), except the
`layer_scalar` buffers, which ties leave alone: the encoder's copies are read (they are what
its causal pass uses) and both are written. The vision tower is not imported.
"""

from __future__ import annotations

from bdlm_jax.checkpoint.hf_tensor import (ACTIVATIONS, LAYER_TYPES, Tensor, require,
                                           shared_config, shortest_period)
from bdlm_jax.config import ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.pattern import attention_shape, layer_types
from bdlm_jax.models.transformer import layer_slots

GEMMA4 = "gemma4_text"
DIFFUSION_GEMMA = "diffusion_gemma"
CANVAS_LENGTH = 256  # DiffusionGemmaConfig's default canvas_length
ARCHITECTURES = {GEMMA4: "Gemma4ForCausalLM", DIFFUSION_GEMMA: "DiffusionGemmaForBlockDiffusion"}
PREFIX = {GEMMA4: "model.", DIFFUSION_GEMMA: "model.decoder."}
# Tensors of a DiffusionGemma folder that are not its text model: left out, with a warning.
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# use_bidirectional_attention values under which text attention stays causal.
BIDIRECTIONAL_TEXT_CAUSAL = (None, "vision")
# The ModelConfig fields that make a model Gemma 4 (any of them set).
FEATURES = ("global_head_dim", "global_n_kv_heads", "attention_k_eq_v", "last_layer_global",
            "v_norm", "moe_beside_dense", "moe_router_norm", "layer_scalar", "self_conditioning")
# Gemma4TextConfig's defaults, for keys a hand-written config.json may leave out.
_DEFAULTS = dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", sliding_window=512,
                 tie_word_embeddings=True, global_head_dim=512, attention_k_eq_v=False,
                 enable_moe_block=False, rms_norm_eps=1e-6)
_ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}

_NORMS = {"input_layernorm.weight": ("attn_norm", "scale"),
          "post_attention_layernorm.weight": ("post_attn_norm", "scale"),
          "pre_feedforward_layernorm.weight": ("mlp_norm", "scale"),
          "post_feedforward_layernorm.weight": ("post_mlp_norm", "scale"),
          "self_attn.q_norm.weight": ("attn", "q_norm", "scale"),
          "self_attn.k_norm.weight": ("attn", "k_norm", "scale")}
_MLP = ("gate_proj", "up_proj", "down_proj")
_EXPERT_LAYER = {  # HF name in a layer -> (our path in its stack, transposed)
    "post_feedforward_layernorm_1.weight": (("post_dense_norm", "scale"), False),
    "post_feedforward_layernorm_2.weight": (("post_experts_norm", "scale"), False),
    "pre_feedforward_layernorm_2.weight": (("mlp", "expert_norm"), False),
    "router.proj.weight": (("mlp", "router", "kernel"), True),
    "router.scale": (("mlp", "router_scale"), False),
    "router.per_expert_scale": (("mlp", "expert_scale"), False),
    "experts.down_proj": (("mlp", "down_proj"), True),
}


def model_type(m: ModelConfig) -> str:
  """`diffusion_gemma` with the self-conditioning module, else `gemma4_text`; a ConfigError
  naming what the family needs when `m` lacks it."""
  diffusion = m.self_conditioning
  name = DIFFUSION_GEMMA if diffusion else GEMMA4
  needs = [f"model.{k}=true" for k in ("qk_norm", "post_norms", "scale_embeddings", "v_norm",
                                       "layer_scalar") if not getattr(m, k)]
  if m.query_pre_attn_scalar != 1:
    needs.append("model.query_pre_attn_scalar=1 (Gemma 4 leaves attention logits unscaled)")
  if layer_types(m)[-1] != "global":
    needs.append("a global last layer (model.last_layer_global=true)")
  if m.moe_experts and not (m.moe_beside_dense and m.moe_router_norm and m.moe_norm_topk):
    needs.append("experts in Gemma 4's form (model.moe_beside_dense, model.moe_router_norm, "
                 "model.moe_norm_topk all true)")
  if m.moe_experts and m.mlp_pattern:
    needs.append("experts in every layer (model.mlp_pattern empty)")
  if m.moe_experts and m.moe_drop_tokens:
    needs.append("model.moe_drop_tokens=false")
  if diffusion and not (m.moe_experts and m.attention_k_eq_v and m.logit_softcap):
    needs.append("experts, model.attention_k_eq_v=true and a model.logit_softcap (DiffusionGemma "
                 "has all three)")
  if needs:
    raise ConfigError(f"no Hugging Face family expresses this model: it has Gemma 4 features, "
                      f"and {name} also needs {'; '.join(needs)}")
  return name


def tensor_map(m: ModelConfig, name: str) -> list[Tensor]:
  """Every HF tensor of `m` as a `name` model, with where it lives in our params pytree."""
  prefix = PREFIX[name]
  out = [Tensor(f"{prefix}embed_tokens.weight", ("embed", "embedding"), False, None)]
  for i, ((stack, j), kind) in enumerate(zip(layer_slots(m), layer_types(m))):
    at = f"{prefix}layers.{i}."
    layer = [Tensor(at + hf, (stack, *ours), False, j) for hf, ours in _NORMS.items()]
    if name == DIFFUSION_GEMMA:  # the encoder's buffer is read, both are written
      layer.append(Tensor(f"model.encoder.language_model.layers.{i}.layer_scalar",
                          (stack, "layer_scalar"), False, j, copies=(at + "layer_scalar",)))
    else:
      layer.append(Tensor(at + "layer_scalar", (stack, "layer_scalar"), False, j))
    projections = ("q_proj", "k_proj", "o_proj") + (() if attention_shape(m, kind).k_eq_v
                                                    else ("v_proj",))
    layer += [Tensor(f"{at}self_attn.{p}.weight", (stack, "attn", p, "kernel"), True, j)
              for p in projections]
    dense = "dense_mlp" if m.moe_experts else "mlp"
    layer += [Tensor(f"{at}mlp.{p}.weight", (stack, dense, p, "kernel"), True, j) for p in _MLP]
    if m.moe_experts:
      layer += [Tensor(at + hf, (stack, *ours), t, j) for hf, (ours, t) in _EXPERT_LAYER.items()]
      layer += [Tensor(f"{at}experts.gate_up_proj", (stack, "mlp", p), True, j, part=(k, 2))
                for k, p in enumerate(("gate_proj", "up_proj"))]
    out += layer
  out.append(Tensor(f"{prefix}norm.weight", ("final_norm", "scale"), False, None))
  if m.self_conditioning:
    sc = f"{prefix}self_conditioning."
    out.append(Tensor(sc + "pre_norm.weight", ("self_conditioning", "pre_norm", "scale"), False,
                      None))
    out += [Tensor(f"{sc}{p}.weight", ("self_conditioning", "mlp", p, "kernel"), True, None)
            for p in _MLP]
  if not m.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), True, None))
  return out


def text_config(hf: dict) -> dict:
  """The text model's config.json keys: DiffusionGemma's `text_config` (with the top-level
  tie), Gemma 4 text's own."""
  if hf.get("model_type") != DIFFUSION_GEMMA:
    return hf
  text = dict(hf.get("text_config") or {})
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  text.setdefault("final_logit_softcapping", 30.0)  # DiffusionGemmaTextConfig's class default
  return text


def model_fields(hf: dict, where: str) -> dict:
  """ModelConfig fields of a Gemma 4 text or DiffusionGemma config.json (a key left out or
  null takes Gemma4TextConfig's default); unsupported variants raise ConfigError."""
  diffusion = hf.get("model_type") == DIFFUSION_GEMMA
  hf = {**_DEFAULTS, **{k: v for k, v in text_config(hf).items() if v is not None}}
  for key, what in (("hidden_size_per_layer_input", "per-layer input embeddings"),
                    ("num_kv_shared_layers", "layers that share K/V")):
    if hf.get(key):
      raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({what}); bdlm_jax "
                        f"needs {key} 0 or null")
  require(hf, where, "attention_bias", (False,), "attention projections have no bias")
  # "vision": bidirectional among image tokens only, so text attends causally as with None;
  # "all" makes the encoder's text attention bidirectional (and halves its window).
  require(hf, where, "use_bidirectional_attention", BIDIRECTIONAL_TEXT_CAUSAL,
          "'all' makes text attention bidirectional; bdlm_jax's encoder stream is causal")
  require(hf, where, "hidden_activation", tuple(ACTIVATIONS), "the MLP is GeGLU or SwiGLU")
  n, n_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  hf_types = hf.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else
                                       "sliding_attention" for i in range(n)]
  unknown = sorted(set(hf_types) - set(LAYER_TYPES))
  if unknown or len(hf_types) != n:
    raise ConfigError(f"{where}: layer_types={hf_types} needs {n} entries of {list(LAYER_TYPES)}")
  types = [LAYER_TYPES[t] for t in hf_types[:-1]] + ["global"]  # HF forces the last one
  period, forced = _layer_period(types)
  k_eq_v = True if diffusion else bool(hf["attention_k_eq_v"])
  head_dim, kv_heads = _global_attention(hf, types, k_eq_v, where)
  rope = {**_ROPE_DEFAULTS, **(hf.get("rope_parameters") or {})}
  local_theta = _rope(rope, "sliding_attention", where, proportional=False)[0]
  theta, fraction = _rope(rope, "full_attention", where, proportional=True)
  n_kv = hf.get("num_key_value_heads") or n_heads
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n, n_heads=n_heads,
      n_kv_heads=n_kv, head_dim=hf["head_dim"], d_ff=hf["intermediate_size"],
      norm_eps=float(hf["rms_norm_eps"]), qk_norm=True, v_norm=True, post_norms=True,
      scale_embeddings=True, layer_scalar=True, query_pre_attn_scalar=1,
      layer_pattern=",".join(period), last_layer_global=forced,
      sliding_window=int(hf["sliding_window"]) if "local" in types else 0,
      rope_theta=theta, rope_local_theta=local_theta if "local" in types else 0.0,
      global_partial_rotary_factor=fraction,
      global_head_dim=0 if head_dim == hf["head_dim"] else head_dim,
      global_n_kv_heads=0 if kv_heads == n_kv else kv_heads, attention_k_eq_v=k_eq_v,
      mlp_activation=ACTIVATIONS[hf["hidden_activation"]],
      logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
      tie_embeddings=bool(hf["tie_word_embeddings"]), self_conditioning=diffusion)
  if diffusion or hf["enable_moe_block"]:
    # Gemma 4 defines no router loss; the aux weight is ours (0: none, as HF trains it).
    fields.update(moe_experts=int(hf["num_experts"]), moe_top_k=int(hf["top_k_experts"]),
                  moe_d_ff=int(hf["moe_intermediate_size"]), moe_norm_topk=True,
                  moe_beside_dense=True, moe_router_norm=True, moe_aux_weight=0.0)
  return fields


def _layer_period(types: list) -> tuple[list, bool]:
  """(the layer pattern's period, whether the last layer is forced global): the shorter of
  the whole list's period and that of all layers but a global last one."""
  whole, rest = shortest_period(types), shortest_period(types[:-1]) if len(types) > 1 else []
  if rest and len(rest) < len(whole):
    return rest, True
  return whole, False


def _global_attention(hf: dict, types: list, k_eq_v: bool, where: str) -> tuple[int, int]:
  """(head dim, K/V heads) of the global layers: one `per_layer_config` entry shared by every
  global layer and none for local ones, or (configs without it) `global_head_dim` and, with
  K = V, `num_global_key_value_heads`."""
  base = (hf["head_dim"], hf.get("num_key_value_heads") or hf["num_attention_heads"])
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    kv = hf.get("num_global_key_value_heads") if k_eq_v else None
    return int(hf["global_head_dim"]), int(kv or base[1])
  shapes = {i: (int(c.get("head_dim", base[0])), int(c.get("num_key_value_heads", base[1])))
            for i, c in ((int(k), c) for k, c in per_layer.items())}
  local = [i for i, s in shapes.items() if types[i] == "local" and s != base]
  found = {shapes.get(i, base) for i, t in enumerate(types) if t == "global"}
  if local or len(found) != 1:
    raise ConfigError(f"{where}: per_layer_config={per_layer} is not supported; bdlm_jax "
                      f"needs one head_dim and num_key_value_heads for every full_attention "
                      f"layer and the base ones for sliding layers")
  return found.pop()


def _rope(rope: dict, layer_type: str, where: str, proportional: bool) -> tuple[float, float]:
  """(base, rotary fraction) of one layer type's `rope_parameters`: "default" everywhere,
  "proportional" (factor 1) on global layers."""
  params = rope.get(layer_type) or {}
  kind = params.get("rope_type", "default")
  allowed = ("default", "proportional") if proportional else ("default",)
  if kind not in allowed or params.get("factor", 1.0) != 1.0:
    raise ConfigError(f"{where}: rope_parameters.{layer_type}={params} is not supported; "
                      f"bdlm_jax implements rope_type {list(allowed)} without a factor there")
  fraction = float(params.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
  return float(params.get("rope_theta", _ROPE_DEFAULTS[layer_type]["rope_theta"])), fraction


def hf_config(m: ModelConfig, name: str, dtype: str, max_positions: int, extra: dict,
              vision: dict | None) -> dict:
  """config.json for `m` that transformers loads as `name` (`vision`: DiffusionGemma's
  vision_config, default a one-layer tower of width 16)."""
  kinds = layer_types(m)
  global_kv, global_dim, _ = attention_shape(m, "global")
  text = {
      "model_type": "diffusion_gemma_text" if name == DIFFUSION_GEMMA else GEMMA4,
      **shared_config(m, max_positions),
      "hidden_activation": {ours: hf for hf, ours in ACTIVATIONS.items()}[m.mlp_activation],
      "layer_types": [{ours: hf for hf, ours in LAYER_TYPES.items()}[k] for k in kinds],
      "sliding_window": m.sliding_window or max_positions,
      "per_layer_config": {str(i): {"head_dim": global_dim, "num_key_value_heads": global_kv}
                           for i, k in enumerate(kinds) if k == "global"},
      "rope_parameters": {
          "sliding_attention": {"rope_type": "default",
                                "rope_theta": m.rope_local_theta or m.rope_theta},
          "full_attention": {"rope_type": "proportional", "rope_theta": m.rope_theta,
                             "partial_rotary_factor": m.global_partial_rotary_factor}},
      "final_logit_softcapping": m.logit_softcap or None,
      "use_bidirectional_attention": None,
  }
  if m.moe_experts:
    text.update(num_experts=m.moe_experts, top_k_experts=m.moe_top_k,
                moe_intermediate_size=m.moe_d_ff or m.d_ff)
  if name == GEMMA4:
    return {"architectures": [ARCHITECTURES[name]], **text, "dtype": dtype,
            "attention_k_eq_v": m.attention_k_eq_v, "enable_moe_block": bool(m.moe_experts),
            "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, **extra}
  return {"architectures": [ARCHITECTURES[name]], "model_type": DIFFUSION_GEMMA, "dtype": dtype,
          "text_config": text, "tie_word_embeddings": m.tie_embeddings,
          "canvas_length": extra.get("bdlm_block_size", CANVAS_LENGTH),
          "vision_config": vision or dict(model_type="gemma4_vision", hidden_size=16,
                                          intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2,
                                          head_dim=8),
          **extra}
