"""Hugging Face Qwen3.5 (`qwen3_5_text`, and the text model of a `qwen3_5` folder) and
Qwen3-Next (`qwen3_next`) <-> bdlm_jax: tensor names and config fields (docs/gdn.md).

Qwen3.5 is Qwen3 with Gated DeltaNet layers (`layer_types` "linear_attention", our kind
`gdn`; the others "full_attention", ours `global`), gated attention (q_proj gives [q | gate]
per head: `attention_gate`), RoPE on the first `partial_rotary_factor` of the head dim, and
zero-centred RMSNorms, x_hat (1 + w): our `scale` is HF's w + 1, added in float32 as HF does
(Gemma 3's convention); the Gated DeltaNet's own RMSNormGated multiplies by w itself. A
`qwen3_5` folder (the multimodal class) keeps the text weights under
`model.language_model.`, which import reads as `model.` (hf_import.py); its vision tower and
`mtp.*` are not read.

Qwen3-Next computes what Qwen3.5-MoE does (same norms, gated attention, partial RoPE, Gated
DeltaNet, router and shared expert; its RoPE is plain 1-D, which is what Qwen3.5's mRoPE is
on text), with three differences in the files: the Gated DeltaNet's input projections are
fused and interleaved per key head (`in_proj_qkvz` holds [q | k | v | z] of each key head's
group of value heads, `in_proj_ba` [b | a]; we read and write our separate projections as
rows of them, as transformers' `fix_query_key_value_ordering` splits them), layers may have
a dense MLP (`decoder_sparse_step`, `mlp_only_layers`: our `mlp_pattern`), and
`norm_topk_prob` may be off. Where both families express a model, export writes Qwen3.5
unless the model came from a Qwen3-Next folder (`like`).
"""

from __future__ import annotations

import numpy as np

from bdlm_jax.checkpoint.hf_tensor import (Rows, Tensor, mlp_pattern, require, shared_config,
                                           shortest_period, sparse_config)
from bdlm_jax.config import ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.pattern import gdn_shape, layer_types, mlp_types
from bdlm_jax.models.transformer import layer_slots

QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT = "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"
# The text models' own types, then the multimodal folders' (text under `text_config`).
MODEL_TYPES = (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, "qwen3_5", "qwen3_5_moe")
ARCHITECTURES = {QWEN3_5: "Qwen3_5ForCausalLM", QWEN3_5_MOE: "Qwen3_5MoeForCausalLM",
                 QWEN3_NEXT: "Qwen3NextForCausalLM"}
KINDS = {"linear_attention": "gdn", "full_attention": "global"}  # HF -> ours
# The ModelConfig fields that make a model Qwen3.5 (any of them set).
FEATURES = ("attention_gate",)

_NORMS = {"input_layernorm.weight": ("attn_norm", "scale"),
          "post_attention_layernorm.weight": ("mlp_norm", "scale")}
_ATTENTION = {f"self_attn.{p}.weight": ("attn", p, "kernel")
              for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
_QK_NORMS = {"self_attn.q_norm.weight": ("attn", "q_norm", "scale"),
             "self_attn.k_norm.weight": ("attn", "k_norm", "scale")}
_GDN_LINEARS = {f"linear_attn.{p}.weight": ("linear_attn", p, "kernel")
                for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
_GDN_OTHERS = {"linear_attn.conv1d.weight": ("linear_attn", "conv"),
               "linear_attn.dt_bias": ("linear_attn", "dt_bias"),
               "linear_attn.A_log": ("linear_attn", "A_log"),
               "linear_attn.norm.weight": ("linear_attn", "norm")}
_MLP = {f"mlp.{p}.weight": ("mlp", p, "kernel") for p in ("gate_proj", "up_proj", "down_proj")}
# An MoE layer's (Qwen3.5-MoE's every layer): a router, experts (saved one SwiGLU per expert,
# as transformers writes them) and a shared expert gated by sigmoid(shared_expert_gate).
_MOE = {"mlp.gate.weight": ("mlp", "router", "kernel"),
        "mlp.shared_expert_gate.weight": ("shared_expert_gate", "kernel"),
        **{f"mlp.shared_expert.{p}.weight": ("shared_expert", p, "kernel")
           for p in ("gate_proj", "up_proj", "down_proj")}}
# Qwen3_5TextConfig's defaults, for keys a hand-written config.json may leave out.
_DEFAULTS = dict(head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                 tie_word_embeddings=False, rms_norm_eps=1e-6, full_attention_interval=4,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 num_experts_per_tok=8, num_experts=256, router_aux_loss_coef=0.001)
# Qwen3NextConfig's, likewise.
_NEXT_DEFAULTS = dict(_DEFAULTS, intermediate_size=5632, num_experts_per_tok=10,
                      num_experts=512, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])


def owns(m: ModelConfig) -> bool:
  """Whether only Qwen3.5 expresses `m` (Gated DeltaNet layers or gated attention)."""
  return "gdn" in layer_types(m) or any(getattr(m, k) for k in FEATURES)


def model_type(m: ModelConfig, like: str | None = None) -> str:
  """`qwen3_5_moe_text` with experts, else `qwen3_5_text`; `qwen3_next` where only it
  expresses `m` (dense and MoE layers mixed, or top-k weights not renormalised), or where
  `like` (the folder `m` came from) is one; a ConfigError naming what the family needs when
  `m` lacks it."""
  moe = bool(m.moe_experts)
  wrong = [f"model.{k}={getattr(m, k)!r}" for k, fits in (
      ("qk_norm", m.qk_norm), ("attention_gate", m.attention_gate),
      ("layer_pattern", set(layer_types(m)) <= {"gdn", "global"}),
      ("mlp_activation", m.mlp_activation == "silu"),
      ("moe_shared_d_ff", bool(m.moe_shared_d_ff) == moe),
      ("post_norms", not m.post_norms), ("scale_embeddings", not m.scale_embeddings),
      ("query_pre_attn_scalar", m.query_pre_attn_scalar in (0, m.head_dim)),
      ("logit_softcap", not m.logit_softcap), ("v_norm", not m.v_norm)) if not fits]
  if wrong:
    raise ConfigError(f"no Hugging Face family expresses this model: its Gated DeltaNet layers "
                      f"or gated attention need Qwen3.5 or Qwen3-Next (q/k norms and gated "
                      f"attention on, only 'gdn' and 'global' layers, SwiGLU MLPs, a shared "
                      f"expert beside experts and none without), which cannot have "
                      f"{', '.join(wrong)}")
  qwen3_5 = not moe or (set(mlp_types(m)) == {"moe"} and m.moe_norm_topk)
  if like == QWEN3_NEXT or not qwen3_5:
    return QWEN3_NEXT
  return QWEN3_5_MOE if moe else QWEN3_5


def _fused_rows(m: ModelConfig) -> dict[str, tuple[str, Rows]]:
  """Qwen3.5's names of the Gated DeltaNet input projections -> Qwen3-Next's fused tensor
  and the rows of it each is. Per key head g, `in_proj_qkvz` holds
  [q_g (K) | k_g (K) | v_g (r V) | z_g (r V)] and `in_proj_ba` [b_g (r) | a_g (r)], r = Hv / Hk
  value heads to a key head, as `fix_query_key_value_ordering` splits them; ours are
  [q | k | v] of all heads, z, b and a."""
  hk, hv, dk, dv = gdn_shape(m)
  r = hv // hk
  qkvz = np.arange(hk * (2 * dk + 2 * r * dv)).reshape(hk, -1)  # its rows, by key head
  q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, r * dv]), axis=1)
  b, a = np.split(np.arange(2 * hv).reshape(hk, -1), 2, axis=1)

  def rows(fused: str, total: int, *parts) -> tuple[str, Rows]:
    index = np.concatenate(parts, axis=None)  # each part key head by key head
    return f"linear_attn.{fused}.weight", Rows(tuple(index.tolist()), total)

  return {"linear_attn.in_proj_qkv.weight": rows("in_proj_qkvz", qkvz.size, q, k, v),
          "linear_attn.in_proj_z.weight": rows("in_proj_qkvz", qkvz.size, z),
          "linear_attn.in_proj_b.weight": rows("in_proj_ba", 2 * hv, b),
          "linear_attn.in_proj_a.weight": rows("in_proj_ba", 2 * hv, a)}


def tensor_map(m: ModelConfig, name: str) -> list[Tensor]:
  """Every HF tensor of `m` (under `model.`) in the family `name`, with where it lives in our
  params pytree."""
  fused = _fused_rows(m) if name == QWEN3_NEXT else {}
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), False, None)]
  for i, ((stack, j), kind, mlp) in enumerate(zip(layer_slots(m), layer_types(m), mlp_types(m))):
    at = f"model.layers.{i}."
    named = [(_NORMS, False, 1.0), (_MOE if mlp == "moe" else _MLP, True, 0.0)]
    named += ([(_GDN_LINEARS, True, 0.0), (_GDN_OTHERS, False, 0.0)] if kind == "gdn" else
              [(_ATTENTION, True, 0.0), (_QK_NORMS, False, 1.0)])
    for names, transposed, offset in named:
      for hf, ours in names.items():
        hf, rows = fused.get(hf, (hf, None))
        out.append(Tensor(at + hf, (stack, *ours), transposed, j, offset, rows=rows))
    out += [Tensor(f"{at}mlp.experts.{e}.{p}.weight", (stack, "mlp", p), True, j, expert=e)
            for e in range(m.moe_experts if mlp == "moe" else 0)
            for p in ("gate_proj", "up_proj", "down_proj")]
  out.append(Tensor("model.norm.weight", ("final_norm", "scale"), False, None, 1.0))
  if not m.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), True, None))
  return out


def text_config(hf: dict) -> dict:
  """The text model's config.json keys: a `qwen3_5` folder's `text_config` (with the
  top-level tie), a `qwen3_5_text` or `qwen3_next` folder's own."""
  if hf.get("model_type") in (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT):
    return hf
  text = dict(hf.get("text_config") or {})
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
  return text


def model_fields(hf: dict, where: str) -> dict:
  """ModelConfig fields of a Qwen3.5 or Qwen3-Next config.json (a key left out or null
  takes Qwen3_5TextConfig's or Qwen3NextConfig's default); unsupported variants raise
  ConfigError."""
  name = hf.get("model_type")
  hf = {**(_NEXT_DEFAULTS if name == QWEN3_NEXT else _DEFAULTS),
        **{k: v for k, v in text_config(hf).items() if v is not None}}
  require(hf, where, "attention_bias", (False,), "attention projections have no bias")
  require(hf, where, "hidden_act", ("silu",), "the MLP is SwiGLU")
  n = hf["num_hidden_layers"]
  every = hf["full_attention_interval"]
  hf_types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else
                                       "linear_attention" for i in range(n)]
  unknown = sorted(set(hf_types) - set(KINDS))
  if unknown or len(hf_types) != n:
    raise ConfigError(f"{where}: layer_types={hf_types} needs {n} entries of {list(KINDS)}")
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"  # 4.x: scaling
  rope = dict(hf.get(key) or {})
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ConfigError(f"{where}: {key}={rope} is not supported; bdlm_jax implements "
                      f"rope_type 'default' (mRoPE of text positions is plain RoPE)")
  experts = dict(moe_experts=int(hf["num_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
                 moe_d_ff=int(hf["moe_intermediate_size"]), moe_norm_topk=True,
                 moe_shared_d_ff=int(hf["shared_expert_intermediate_size"]),
                 moe_aux_weight=float(hf["router_aux_loss_coef"]))
  if name == QWEN3_NEXT:  # its MoE layers as transformers picks them (none without experts)
    pattern = mlp_pattern(hf, where) if experts["moe_experts"] else None
    experts.update(mlp_pattern=pattern, moe_norm_topk=bool(hf["norm_topk_prob"]))
  else:
    pattern = "" if name in (QWEN3_5_MOE, "qwen3_5_moe") else None
  return dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n,
      n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
      d_ff=int(hf.get("intermediate_size") or hf["moe_intermediate_size"]),  # dense layers
      head_dim=hf["head_dim"], norm_eps=float(hf["rms_norm_eps"]),
      tie_embeddings=bool(hf["tie_word_embeddings"]), qk_norm=True, attention_gate=True,
      layer_pattern=",".join(KINDS[t] for t in shortest_period(hf_types)),
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                           hf.get("partial_rotary_factor", 0.25))),
      gdn_key_heads=hf["linear_num_key_heads"], gdn_value_heads=hf["linear_num_value_heads"],
      gdn_key_dim=hf["linear_key_head_dim"], gdn_value_dim=hf["linear_value_head_dim"],
      gdn_conv=hf["linear_conv_kernel_dim"], **(experts if pattern is not None else {}))


def hf_config(m: ModelConfig, name: str, dtype: str, max_positions: int, extra: dict) -> dict:
  """config.json for `m` that transformers loads as family `name`'s causal LM
  (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` or `Qwen3NextForCausalLM`)."""
  hk, hv, dk, dv = gdn_shape(m)
  ours = {kind: hf for hf, kind in KINDS.items()}
  experts = {"num_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
             "moe_intermediate_size": m.moe_d_ff or m.d_ff,
             "shared_expert_intermediate_size": m.moe_shared_d_ff,
             "router_aux_loss_coef": m.moe_aux_weight, "output_router_logits": False}
  if name == QWEN3_NEXT:
    experts.update(norm_topk_prob=m.moe_norm_topk, **sparse_config(mlp_types(m)))
  return {
      "architectures": [ARCHITECTURES[name]],
      "model_type": name,
      **shared_config(m, max_positions),
      "dtype": dtype,
      "hidden_act": "silu",
      "layer_types": [ours[k] for k in layer_types(m)],
      "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                          "partial_rotary_factor": m.partial_rotary_factor},
      "linear_num_key_heads": hk, "linear_num_value_heads": hv,
      "linear_key_head_dim": dk, "linear_value_head_dim": dv,
      "linear_conv_kernel_dim": m.gdn_conv,
      **(experts if m.moe_experts else {"num_experts": 0} if name == QWEN3_NEXT else {}),
      **extra,
  }
