"""Scaled RoPE and the Qwen2 / Mistral families against `transformers` (CPU PyTorch): import
gives its logits at positions several times past the model's original length, and the
export reloads in transformers with the same logits and the same RoPE parameters."""

import json
import os

import numpy as np
import pytest

from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf, params_from_hf
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.models import rope
from tests.checkpoint.test_hf import (GEMMA3_SHAPES, SHAPES, edit_config, jax_logits,
                                      random_hf_model, torch_logits, write_config)

RTOL = 1e-4  # of the largest logit, float32
ORIGINAL = 16  # original_max_position_embeddings: the tokens reach 4x past it
LENGTH = 4 * ORIGINAL
VOCAB = 64
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=ORIGINAL)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)
# A ramp across the interior pairs (beta_fast, beta_slow) and DeepSeek's attention factor.
YARN_TUNED = dict(YARN, beta_fast=2.0, beta_slow=0.05, mscale=1.0, mscale_all_dim=0.5)
CASES = {  # name: (config class, config keys)
    "llama_llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3)),
    "llama_linear": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", factor=4.0))),
    # Dynamic NTK scales from max_position_embeddings; LongRoPE's factor is the two lengths'.
    "llama_dynamic": ("LlamaConfig", dict(rope_parameters=dict(rope_type="dynamic", factor=4.0),
                                          max_position_embeddings=ORIGINAL)),
    "llama_longrope": ("LlamaConfig", dict(
        rope_parameters=dict(rope_type="longrope", long_factor=[1.0, 2.5, 4.0, 7.0],
                             short_factor=[1.0, 1.1, 1.2, 1.3],
                             original_max_position_embeddings=ORIGINAL),
        max_position_embeddings=LENGTH)),
    "qwen3_yarn": ("Qwen3Config", dict(rope_parameters=YARN)),
    "qwen2_yarn": ("Qwen2Config", dict(rope_parameters=YARN_TUNED)),
    "mistral_window_linear": ("MistralConfig", dict(
        sliding_window=5, rope_parameters=dict(rope_type="linear", factor=2.0))),
    "gemma3_linear": ("Gemma3TextConfig", dict(GEMMA3_SHAPES, rope_parameters={
        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def scaled(request, tmp_path_factory):
  config_cls, keys = CASES[request.param]
  keys = {**SHAPES, **keys} if config_cls != "Gemma3TextConfig" else keys
  return random_hf_model(config_cls, dict(keys, vocab_size=VOCAB),
                         str(tmp_path_factory.mktemp(request.param)), (1, LENGTH))


def at_length(cfg, length: int):
  """`cfg` training sequences of `length` tokens, its length-dependent RoPE fixed there."""
  m = cfg.model
  return replace(cfg, data=dict(seq_len=length),
                 model=dict(rope_scaling=rope.at_length(m.rope_scaling, length),
                            rope_local_scaling=rope.at_length(m.rope_local_scaling, length)))


def relative_error(logits, reference) -> float:
  return float(np.abs(logits[..., :VOCAB] - reference).max() / np.abs(reference).max())


def test_import_gives_the_logits_of_transformers_past_the_original_length(scaled):
  cfg, params = import_hf(scaled.folder)
  hf = json.load(open(os.path.join(scaled.folder, "config.json")))
  assert cfg.model.qkv_bias == (hf["model_type"] == "qwen2")
  assert (cfg.model.layer_pattern == "local") == (hf["model_type"] == "mistral")
  err = relative_error(jax_logits(params, at_length(cfg, LENGTH), scaled.tokens), scaled.logits)
  print(f"{hf['model_type']} {rope.parse(cfg.model.rope_scaling).get('rope_type', 'default')}: "
        f"import relative error {err:.2e}")
  assert err < RTOL


def test_export_reloads_in_transformers_with_the_same_logits_and_rope(scaled, tmp_path):
  import transformers
  cfg, params = import_hf(scaled.folder)
  cfg = at_length(cfg, LENGTH)
  export_hf(params, cfg, str(tmp_path))
  loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                             attn_implementation="eager")
  err = relative_error(torch_logits(loaded, scaled.tokens), scaled.logits)
  print(f"{loaded.config.model_type}: export relative error {err:.2e}")
  assert err < RTOL
  ours, theirs = loaded.model.rotary_emb, scaled.torch_model.model.rotary_emb
  for name, buffer in theirs.named_buffers():  # inv_freq, per layer type where it has them
    np.testing.assert_array_equal(dict(ours.named_buffers())[name].numpy(), buffer.numpy())
  scales = lambda m: {k: v for k, v in vars(m).items() if k.endswith("attention_scaling")}
  assert scales(ours) == scales(theirs) != {}
  original = scaled.torch_model.config.rope_parameters
  for kind, params_ in (original.items() if "full_attention" in original else [(None, original)]):
    written = loaded.config.rope_parameters if kind is None else loaded.config.rope_parameters[kind]
    assert {k: written.get(k) for k in params_} == params_
  assert import_hf(str(tmp_path))[0].model == import_hf(scaled.folder)[0].model


@pytest.mark.parametrize("scaled", ["llama_llama3", "gemma3_linear"], indirect=True)
def test_transformers_4_rope_scaling_imports_alike(scaled, tmp_path):
  """4.x files: rope_scaling (Gemma 3: the global layers'; local ones plain at
  rope_local_base_freq) and a top-level rope_theta."""
  cfg = import_hf(scaled.folder)[0]
  hf = edit_config(scaled.folder, tmp_path)
  params = hf.pop("rope_parameters")
  params = params.get("full_attention", params)
  hf.update(rope_theta=params.pop("rope_theta"), rope_scaling=params)
  write_config(tmp_path, hf)
  assert import_hf(str(tmp_path))[0].model == cfg.model


@pytest.mark.parametrize("scaled", ["qwen2_yarn"], indirect=True)
def test_a_family_s_variant_bdlm_jax_lacks_is_named(scaled, tmp_path):
  hf = edit_config(scaled.folder, tmp_path)
  write_config(tmp_path, {**hf, "use_sliding_window": True})
  with pytest.raises(ConfigError, match=r"use_sliding_window=True is not supported \(every "
                                        r"layer attends to the full context\)"):
    import_hf(str(tmp_path))


@pytest.mark.parametrize("scaled", ["llama_llama3"], indirect=True)
def test_context_extension_at_conversion_says_what_changed_and_exports_it(scaled, tmp_path,
                                                                          capsys):
  cfg, params = import_hf(scaled.folder)
  longer = json.dumps({**json.loads(cfg.model.rope_scaling), "factor": 64.0})
  extended = replace(cfg, init_from=scaled.folder,
                     model=dict(rope_scaling=longer, rope_theta=1e4))
  params = params_from_hf(extended)
  said = capsys.readouterr().out.splitlines()
  assert said == [f"init_from={scaled.folder}: model.rope_theta was 500.0, now 10000.0",
                  f"init_from={scaled.folder}: model.rope_scaling was "
                  f"{cfg.model.rope_scaling!r}, now {longer!r}"]
  export_hf(params, extended, str(tmp_path))
  written = json.load(open(tmp_path / "config.json"))["rope_parameters"]
  assert written == {**LLAMA3, "factor": 64.0, "rope_theta": 1e4}
