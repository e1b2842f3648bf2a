"""Qwen3.5 and Qwen3-Next (Gated DeltaNet hybrids) import/export: causal logits equal
transformers' on tiny random hybrids, and an export loads back in transformers with the same
logits."""


import json
import os
import warnings

import jax
import numpy as np
import pytest
import safetensors.numpy

from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
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
# Qwen3-Next: fused, interleaved GDN projections; the last layer's MLP dense (so not a
# period of the layers: mlp_pattern moe x 4, dense), top-k weights not renormalised.
NEXT_SHAPES = dict(MOE_SHAPES, mlp_only_layers=[4], norm_topk_prob=False)
CASES = {"qwen3_5": ("Qwen3_5TextConfig", SHAPES, "Qwen3_5ForCausalLM"),
         "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE_SHAPES, "Qwen3_5MoeForCausalLM"),
         "qwen3_next": ("Qwen3NextConfig", NEXT_SHAPES, "Qwen3NextForCausalLM")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """Case name -> its model (`build`), each built once."""
  models = {}
  def get(name):
    if name not in models:
      models[name] = build(name, str(tmp_path_factory.mktemp(name)))
    return models[name]
  return get


@pytest.fixture(params=sorted(CASES))
def qwen3_5(request, built):
  return built(request.param)


def build(name: str, folder: str):
  """A random Qwen3.5 (dense or MoE) or Qwen3-Next causal LM saved to `folder`, its tokens
  [2, 80] (two chunks of the delta rule), its logits and class name. Weights are 0.1 N(0, 1)
  (zero-centred norms' w too; the gated norm's weight 1 + 0.1 N; routers 0.5 N, so routing is
  far from uniform), A_log and dt_bias keep transformers' init: with larger weights
  transformers' own float32 logits drift 1e-4 from its float64 ones."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config_cls, shapes, class_name = CASES[name]
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
  model.save_pretrained(folder)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 80))
  return folder, tokens, torch_logits(model, tokens), class_name


@pytest.mark.slow
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


def export_and_check(folder: str, out: str, tokens, want, class_name: str, **source) -> None:
  """Imports `folder`, exports it to `out` (`source`: the cfg's `init_from`), checks that
  transformers loads `out` as `class_name` with the logits `want` and that it re-imports to
  the same model and params."""
  import transformers
  cfg, params = import_hf(folder)
  cfg = replace(cfg, objective=dict(mask_token_id=5, block_size=4), **source)
  export_hf(params, cfg, out)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert type(loaded).__name__ == class_name
  err = np.abs(torch_logits(loaded, tokens)[..., :VOCAB] - want).max()
  assert err < 1e-5, f"max abs logit error {err}"
  cfg2, params2 = import_hf(out)
  assert cfg2.model == cfg.model
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_export_loads_in_transformers_and_round_trips(qwen3_5, tmp_path):
  folder, tokens, want, class_name = qwen3_5
  export_and_check(folder, str(tmp_path / "export"), tokens, want, class_name)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_a_model_both_families_express_is_written_as_its_source_family(built, name, tmp_path):
  """Qwen3-Next expresses a Qwen3.5 model too (dense: num_experts 0): exported from a model
  whose folder (init_from) is Qwen3-Next, it is written as Qwen3-Next, with the same logits."""
  folder, tokens, want, _ = built(name)
  export_and_check(folder, str(tmp_path / "export"), tokens, want, "Qwen3NextForCausalLM",
                   init_from=built("qwen3_next")[0])


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_a_multimodal_folder_imports_its_text_model_alike(built, name, tmp_path):
  """`qwen3_5` folders (Qwen3_5ForConditionalGeneration) nest the text config under
  `text_config` and the text weights under `model.language_model.`; the vision tower and the
  MTP head are left out."""
  folder, _, _, _ = built(name)
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


def test_fused_projection_rows_read_any_slice_of_ours_and_export_back():
  """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` interleave our q, k, v, z, b, a per key head,
  as transformers' `fix_query_key_value_ordering` splits them (redone here on the weights);
  a device's slice of ours (any axis sharded) reads its rows, and export rebuilds them."""
  from bdlm_jax.checkpoint.hf_export import _assemble
  from bdlm_jax.checkpoint.hf_names import tensor_map
  hk, hv, k, v, d = 2, 4, 3, 2, 5
  m = replace(Config(), model=dict(n_layers=4, layer_pattern="gdn,gdn,gdn,global", d_model=d,
                                   qk_norm=True, attention_gate=True, gdn_key_heads=hk,
                                   gdn_value_heads=hv, gdn_key_dim=k, gdn_value_dim=v)).model
  rng = np.random.default_rng(0)
  hf = {"in_proj_qkvz": rng.normal(size=(hk * (2 * k + 2 * hv // hk * v), d)),
        "in_proj_ba": rng.normal(size=(2 * hv, d))}
  q_, k_, v_, z_ = np.split(hf["in_proj_qkvz"].reshape(hk, -1, d), np.cumsum([k, k, hv // hk * v]),
                            axis=1)
  b_, a_ = np.split(hf["in_proj_ba"].reshape(hk, -1, d), 2, axis=1)
  ours = {"in_proj_qkv": np.concatenate([x.reshape(-1, d) for x in (q_, k_, v_)]).T,
          "in_proj_z": z_.reshape(-1, d).T, "in_proj_b": b_.reshape(-1, d).T,
          "in_proj_a": a_.reshape(-1, d).T}
  fused = [t for t in tensor_map(m, "qwen3_next") if t.rows and t.layer == 0]
  assert sorted(t.path[2] for t in fused) == sorted(ours)
  for t in fused:
    x, whole = ours[t.path[2]], hf[t.name.split(".")[-2]]
    assert t.hf_shape(x.shape) == whole.shape
    for index in [(slice(None),) * 2, (slice(1, 3), slice(None)), (slice(None), slice(2, 4))]:
      np.testing.assert_array_equal(t.take_rows(whole[t.hf_index(index, x.shape)], index).T,
                                    x[index])
  for name, whole in hf.items():
    parts = [(t.out_rows(ours[t.path[2]].T.shape), ours[t.path[2]].T) for t in fused
             if t.name.endswith(f"{name}.weight")]
    np.testing.assert_array_equal(_assemble(parts), whole)


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters=None, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"rope_scaling=.* is not supported"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be >= 1"),
])
def test_unsupported_qwen3_next_config_is_a_config_error(built, tmp_path, change, message):
  hf = json.load(open(os.path.join(built("qwen3_next")[0], "config.json")))
  json.dump({**hf, **change}, open(tmp_path / "config.json", "w"))
  with pytest.raises(ConfigError, match=message):
    import_hf(str(tmp_path))
