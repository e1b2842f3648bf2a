"""Qwen3.5 (Gated DeltaNet hybrid) import/export: causal logits equal transformers' on a
tiny random hybrid, and an export loads back in transformers with the same logits."""


import json
import os
import warnings

import jax
import numpy as np
import pytest
import safetensors.numpy

from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf
from bdlm_jax.configure import replace
from bdlm_jax.loss import ar_logits

TOL = 1e-4
VOCAB = 64
# 3 GDN layers and a gated attention layer (a period) plus a GDN remainder; 2 key heads
# repeated to 4 value heads; RoPE on a quarter of head_dim 16.
SHAPES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=48, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                   partial_rotary_factor=0.25))


def torch_logits(model, tokens) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(tokens), use_cache=False).logits.float().numpy()


# 4 experts, 2 per token, and a shared expert, in every layer.
MOE_SHAPES = dict(SHAPES, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  num_experts=4, num_experts_per_tok=2)
CASES = {"qwen3_5": ("Qwen3_5TextConfig", SHAPES, "Qwen3_5ForCausalLM"),
         "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE_SHAPES, "Qwen3_5MoeForCausalLM")}


@pytest.fixture(scope="module", params=sorted(CASES))
def qwen3_5(request, tmp_path_factory):
  """A random Qwen3.5 (dense or MoE) causal LM saved to a folder, its tokens [2, 80] (two
  chunks of the delta rule), its logits and class name. Weights are 0.1 N(0, 1)
  (zero-centred norms' w too; the gated norm's weight 1 + 0.1 N; routers 0.5 N, so routing is
  far from uniform), A_log and dt_bias keep transformers' init: with larger weights
  transformers' own float32 logits drift 1e-4 from its float64 ones."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config_cls, shapes, class_name = CASES[request.param]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      getattr(transformers, config_cls)(**shapes), attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("linear_attn.norm.weight"):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      elif name.endswith("mlp.gate.weight"):
        p.copy_(0.5 * torch.randn_like(p))
      elif not name.endswith(("A_log", "dt_bias")):
        p.copy_(0.1 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(folder)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 80))
  return folder, tokens, torch_logits(model, tokens), class_name


def test_import_gives_the_logits_of_transformers(qwen3_5):
  folder, tokens, want, _ = qwen3_5
  cfg, params = import_hf(folder)
  m = cfg.model
  assert (m.layer_pattern, m.attention_gate, m.partial_rotary_factor) == (
      "gdn,gdn,gdn,global", True, 0.25)
  assert (m.gdn_key_heads, m.gdn_value_heads, m.gdn_key_dim, m.gdn_value_dim) == (2, 4, 8, 6)
  got = np.asarray(jax.jit(lambda p: ar_logits(p, cfg, tokens))(params))[..., :VOCAB]
  err = np.abs(got - want).max()
  assert err < TOL, f"max abs logit error {err}"


def test_export_loads_in_transformers_and_round_trips(qwen3_5, tmp_path):
  import transformers
  folder, tokens, want, class_name = qwen3_5
  cfg, params = import_hf(folder)
  cfg = replace(cfg, objective=dict(mask_token_id=5, block_size=4))
  out = str(tmp_path / "export")
  export_hf(params, cfg, out)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert type(loaded).__name__ == class_name
  err = np.abs(torch_logits(loaded, tokens)[..., :VOCAB] - want).max()
  assert err < 1e-5, f"max abs logit error {err}"
  cfg2, params2 = import_hf(out)
  assert cfg2.model == cfg.model
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_a_multimodal_folder_imports_its_text_model_alike(qwen3_5, tmp_path):
  """`qwen3_5` folders (Qwen3_5ForConditionalGeneration) nest the text config under
  `text_config` and the text weights under `model.language_model.`; the vision tower and the
  MTP head are left out."""
  folder, _, _, _ = qwen3_5
  cfg, params = import_hf(folder)
  text = json.load(open(os.path.join(folder, "config.json")))
  multimodal = dict(model_type=text["model_type"].removesuffix("_text"), text_config=text,
                    tie_word_embeddings=text["tie_word_embeddings"])
  json.dump(multimodal, open(tmp_path / "config.json", "w"))
  tensors = safetensors.numpy.load_file(os.path.join(folder, "model.safetensors"))
  tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.")
             else name: x for name, x in tensors.items()}
  tensors.update({"model.visual.patch_embed.weight": np.zeros(3, np.float32),
                  "mtp.fc.weight": np.zeros(3, np.float32)})
  safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing left unread
    cfg2, params2 = import_hf(str(tmp_path))
  assert cfg2.model == cfg.model
  jax.tree.map(np.testing.assert_array_equal, params2, params)
