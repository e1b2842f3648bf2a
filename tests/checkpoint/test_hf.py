"""Hugging Face import/export: parity with `transformers` (CPU PyTorch), round trips, mesh
placement, the export command, and one clear error per bad input."""

import dataclasses
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import run
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf, params_from_hf
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.loss import ar_logits, canvas_logits
from bdlm_jax.models.transformer import layer_slots
from bdlm_jax.params import abstract_params, init_params
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.zero3 import zero3_shardings
from bdlm_jax.train import init_state

TOL = 1e-5
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rope_theta=500.0, rms_norm_eps=1e-5)
# Gemma 3's 5:1 local:global pattern over 7 layers (a remainder after one period), a window
# shorter than the tokens, an attention scale that is not head_dim's, and a logit soft cap.
GEMMA3_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     query_pre_attn_scalar=24, sliding_window=5, rope_theta=1e6,
                     rope_local_base_freq=1e4, final_logit_softcapping=10.0, rms_norm_eps=1e-6)
# 4 experts, 2 per token, narrower than the dense intermediate_size (unused: every layer is MoE).
MOE_SHAPES = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=4, num_experts_per_tok=2, rope_theta=1e4, rms_norm_eps=1e-6)
CONFIGS = {"llama": ("LlamaConfig", SHAPES), "qwen3": ("Qwen3Config", SHAPES),
           "qwen3_moe": ("Qwen3MoeConfig", MOE_SHAPES),
           "gemma3_text": ("Gemma3TextConfig", GEMMA3_SHAPES)}
CASES = {  # name: (model_type, tie_word_embeddings, vocab_size, save_pretrained max_shard_size,
           #        other config keys)
    "llama_untied_sharded": ("llama", False, 300, "20KB", {}),
    "llama_tied": ("llama", True, 64, None, {}),
    "qwen3_tied": ("qwen3", True, 128, None, {}),
    "qwen3_moe_norm_topk_sharded": ("qwen3_moe", False, 300, "20KB", dict(norm_topk_prob=True)),
    # Dense layers 0 and 2 around MoE layer 1 (decoder_sparse_step 2): a scanned period and a
    # remainder, two stacks of layer weights.
    "qwen3_moe_raw_topk_mixed": ("qwen3_moe", False, 300, None,
                                 dict(norm_topk_prob=False, num_hidden_layers=3,
                                      decoder_sparse_step=2)),
    "gemma3_tied": ("gemma3_text", True, 300, None, {}),
}
MOE_CASES = [name for name in sorted(CASES) if CASES[name][0] == "qwen3_moe"]


@dataclasses.dataclass
class HFModel:
  folder: str
  torch_model: object
  tokens: np.ndarray  # [2, 24]
  logits: np.ndarray  # the PyTorch logits of `tokens`, float32


def torch_logits(model, tokens) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.float().numpy()


def jax_logits(params, cfg, tokens) -> np.ndarray:
  return np.asarray(jax.jit(lambda p: ar_logits(p, cfg, tokens))(params))


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_model(request, tmp_path_factory) -> HFModel:
  """A random `transformers` model saved to a folder, with weights far from their init
  values (norm weights too: Gemma's w of (1 + w) as well), so that every mapping error shows
  in the logits. MoE routers get a larger spread, so that routing is far from uniform."""
  model_type, tie, vocab, shard, keys = CASES[request.param]
  config_cls, shapes = CONFIGS[model_type]
  return random_hf_model(config_cls, dict(vocab_size=vocab, tie_word_embeddings=tie,
                                          **{**shapes, **keys}),
                         str(tmp_path_factory.mktemp(request.param)), (2, 24), shard)


def random_hf_model(config_cls: str, keys: dict, folder: str, tokens_shape: tuple,
                    shard: str | None = None) -> HFModel:
  """A `transformers` model of `config_cls(**keys)` with random weights (see `hf_model`)
  saved to `folder`, and its logits of random tokens of `tokens_shape`."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = getattr(transformers, config_cls)(**keys)
  model = transformers.AutoModelForCausalLM.from_config(config,
                                                        attn_implementation="eager").eval()
  norm_center = 0.0 if config.model_type == "gemma3_text" else 1.0
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(norm_center + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.5 * torch.randn_like(p) if name.endswith("mlp.gate.weight")  # router
              else 0.2 * torch.randn_like(p))
  model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, tokens_shape)
  return HFModel(folder, model, tokens, torch_logits(model, tokens))


@pytest.mark.slow
def test_import_gives_the_logits_of_transformers(hf_model):
  cfg, params = import_hf(hf_model.folder)
  hf = json.load(open(os.path.join(hf_model.folder, "config.json")))
  assert cfg.model.qk_norm == (hf["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text"))
  assert cfg.model.tie_embeddings == hf["tie_word_embeddings"]
  # No tokenizer.json tells which ids are free: [MASK] gets a new row, the last.
  vocab = hf["vocab_size"]
  assert (cfg.model.vocab_size, cfg.objective.mask_token_id) == (vocab + 1, vocab)
  err = np.abs(jax_logits(params, cfg, hf_model.tokens)[..., :vocab] - hf_model.logits).max()
  assert err < TOL, f"max abs logit error {err}"


def test_export_loads_in_transformers_and_round_trips(hf_model, tmp_path):
  import transformers
  cfg, params = import_hf(hf_model.folder)
  cfg = replace(cfg, objective=dict(mask_token_id=5, block_size=4))
  out = str(tmp_path / "export")
  export_hf(params, cfg, out, max_shard_bytes=20_000)  # several shards + an index
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))

  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert (loaded.config.bdlm_mask_token_id, loaded.config.bdlm_block_size) == (5, 4)
  vocab = hf_model.logits.shape[-1]  # the [MASK] row import_hf added is exported too
  err = np.abs(torch_logits(loaded, hf_model.tokens)[..., :vocab] - hf_model.logits).max()
  assert err < TOL, f"max abs logit error {err}"

  cfg2, params2 = import_hf(out)
  assert cfg2.model == cfg.model
  assert (cfg2.objective.mask_token_id, cfg2.objective.block_size) == (5, 4)
  jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("hf_model", ["gemma3_tied"], indirect=True)
def test_gemma3_import_reads_its_features(hf_model):
  """Layer pattern (the shortest period of layer_types), window, both RoPE bases, scales,
  and norm scales that are exactly HF's float32 1 + w."""
  cfg, params = import_hf(hf_model.folder)
  m = cfg.model
  assert (m.n_layers, m.layer_pattern) == (7, "local,local,local,local,local,global")
  assert (m.sliding_window, m.rope_theta, m.rope_local_theta) == (5, 1e6, 1e4)
  assert (m.query_pre_attn_scalar, m.logit_softcap, m.mlp_activation) == (24, 10.0, "gelu_tanh")
  assert m.qk_norm and m.post_norms and m.scale_embeddings and m.tie_embeddings
  w = hf_model.torch_model.model.layers[6].post_feedforward_layernorm.weight.detach().numpy()
  np.testing.assert_array_equal(params["layers"]["post_mlp_norm"]["scale"][6], np.float32(1) + w)


@pytest.mark.parametrize("hf_model", MOE_CASES, indirect=True)
def test_qwen3_moe_import_reads_its_experts(hf_model):
  """Expert count, k, width and norm_topk_prob from a config.json transformers wrote (it
  spells the count num_local_experts; export_hf's num_experts is read by the round trip),
  each expert's weights in its [layer, expert] slice, and routing sharp enough that renormalising
  the k weights or not moves the logits far beyond the parity tolerance."""
  cfg, params = import_hf(hf_model.folder)
  hf = json.load(open(os.path.join(hf_model.folder, "config.json")))
  assert (hf["num_local_experts"], hf.get("num_experts")) == (4, None)
  m = cfg.model
  assert (m.moe_experts, m.moe_top_k, m.moe_d_ff, m.d_ff) == (4, 2, 16, 48)
  assert (m.moe_norm_topk, m.moe_aux_weight) == (hf["norm_topk_prob"], 0.001)
  experts = hf_model.torch_model.model.layers[1].mlp.experts
  gate_up_EID, down_EDI = (x.detach().numpy() for x in (experts.gate_up_proj, experts.down_proj))
  stack, index = layer_slots(m)[1]
  mlp = params[stack]["mlp"]
  np.testing.assert_array_equal(mlp["gate_proj"][index, 3], gate_up_EID[3, :16].T)
  np.testing.assert_array_equal(mlp["up_proj"][index, 3], gate_up_EID[3, 16:].T)
  if hf["decoder_sparse_step"] == 2:  # layers 0 and 2 dense, in their own stack
    assert m.mlp_pattern == "dense,moe" and params["dense_layers"]["mlp"]["gate_proj"][
        "kernel"].shape == (2, 32, 48)
  np.testing.assert_array_equal(mlp["down_proj"][1, 3], down_EDI[3].T)
  flipped = replace(cfg, model=dict(moe_norm_topk=not m.moe_norm_topk))
  vocab = hf["vocab_size"]
  err = np.abs(jax_logits(params, flipped, hf_model.tokens)[..., :vocab] - hf_model.logits).max()
  assert err > 1000 * TOL, f"routing too flat to test: the other norm_topk_prob errs by {err}"


@pytest.mark.parametrize("hf_model", ["llama_tied"], indirect=True)
def test_run_export_writes_the_latest_checkpoint(hf_model, tmp_path):
  """`run.py --set mode=export` restores a train state and writes what transformers loads."""
  import transformers
  cfg, params = import_hf(hf_model.folder)
  cfg = replace(cfg, data=dict(seq_len=16), objective=dict(block_size=4))
  config_file = tmp_path / "cfg.py"
  config_file.write_text(f"def get_config():\n  return {cfg.to_dict()!r}\n")
  workdir, out = str(tmp_path / "work"), str(tmp_path / "hf")
  mesh = make_mesh(cfg)
  with Checkpointer(workdir, cfg, save_every=1, max_to_keep=2, async_save=False) as ckpt:
    state = init_state(cfg, jax.random.key(0), mesh, params)
    ckpt.save(1, state._replace(params=jax.tree.map(jnp.zeros_like, params)))  # an older step
    ckpt.save(2, state)

  argv = ["--config", str(config_file), "--workdir", workdir, "--set", "mode=export"]
  assert run.main(argv) == 2  # no export.out_dir
  assert run.main(argv + ["--set", f"export.out_dir={out}"]) == 0
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert loaded.config.bdlm_block_size == 4
  vocab = hf_model.logits.shape[-1]
  err = np.abs(torch_logits(loaded, hf_model.tokens)[..., :vocab] - hf_model.logits).max()
  assert err < TOL, f"max abs logit error {err}"


# The tests below need no PyTorch: their folders come from export_hf.

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(cfg, params, folder): random bdlm_jax params written by export_hf."""
  cfg = replace(Config(), model=dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                     n_kv_heads=2, head_dim=8, d_ff=64, qk_norm=True,
                                     tie_embeddings=False),
                objective=dict(mask_token_id=63))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                        abstract_params(cfg))
  folder = str(tmp_path_factory.mktemp("exported"))
  export_hf(params, cfg, folder)
  return cfg, params, folder


@pytest.fixture(scope="module")
def exported_gemma3(tmp_path_factory):
  """(cfg, folder): a random Gemma 3-style model written by export_hf."""
  cfg = replace(Config(), model=dict(
      vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
      qk_norm=True, post_norms=True, scale_embeddings=True, mlp_activation="gelu_tanh",
      layer_pattern="local,local,global", sliding_window=4, rope_local_theta=1e4,
      query_pre_attn_scalar=16, logit_softcap=30.0), objective=dict(mask_token_id=63))
  folder = str(tmp_path_factory.mktemp("exported_gemma3"))
  export_hf(init_params(cfg, jax.random.key(0)), cfg, folder)
  return cfg, folder


@pytest.fixture(scope="module")
def exported_moe(tmp_path_factory):
  """(cfg, folder): a random Qwen3-MoE-style model written by export_hf."""
  cfg = replace(Config(), model=dict(
      vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
      qk_norm=True, moe_experts=4, moe_top_k=2, moe_d_ff=16), objective=dict(mask_token_id=63))
  folder = str(tmp_path_factory.mktemp("exported_moe"))
  export_hf(init_params(cfg, jax.random.key(0)), cfg, folder)
  return cfg, folder


def test_gemma3_config_of_transformers_4_imports_alike(exported_gemma3, tmp_path):
  """transformers 4.x files: sliding_window_pattern, rope_theta and rope_local_base_freq."""
  cfg, folder = exported_gemma3
  hf = edit_config(folder, tmp_path)
  assert hf["sliding_window_pattern"] == 3
  del hf["layer_types"], hf["rope_parameters"]
  write_config(tmp_path, {**hf, "rope_scaling": None})
  assert import_hf(str(tmp_path))[0].model == cfg.model


@pytest.mark.parametrize("model, message", [
    (dict(layer_pattern="local,global", sliding_window=4),
     r"Mistral \(every layer local\) cannot have model.layer_pattern='local,global'"),
    (dict(qkv_bias=True, qk_norm=True), r"q/k/v biases \(model.qkv_bias\) need Qwen2, which "
                                        r"has no experts, no q/k norms"),
    (dict(rope_scaling='{"rope_type": "linear", "factor": 2}', attention_gate=True),
     r"the Gemma 4 and Qwen3.5 families keep plain RoPE"),
    (dict(mlp_activation="gelu_tanh", logit_softcap=30.0),
     r"cannot have model.mlp_activation='gelu_tanh', model.logit_softcap=30.0"),
    (dict(post_norms=True), r"Gemma 3 also needs model.scale_embeddings, model.qk_norm=true"),
    (dict(moe_experts=4), r"experts \(model.moe_experts=4\) need Qwen3-MoE, which has q/k norms"),
    (dict(moe_experts=4, qk_norm=True, post_norms=True, scale_embeddings=True),
     r"need Qwen3-MoE, which has q/k norms and no Gemma 3 features"),
    (dict(moe_experts=4, qk_norm=True, logit_softcap=30.0),
     r"experts need Qwen3-MoE, which cannot have model.logit_softcap=30.0"),
])
def test_export_refuses_a_model_no_hf_family_expresses(tmp_path, model, message):
  cfg = replace(Config(), model=model)
  with pytest.raises(ConfigError, match=message):  # before it reads a param
    export_hf(abstract_params(cfg), cfg, str(tmp_path))
  assert not os.listdir(tmp_path)


def test_import_onto_an_fsdp_mesh_keeps_values_and_shards_params(exported):
  cfg, params, folder = exported
  mesh = make_mesh(replace(cfg, parallel=dict(fsdp=8)))
  _, sharded = import_hf(folder, mesh=mesh)
  expected = zero3_shardings(mesh, abstract_params(cfg))
  assert jax.tree.map(lambda x: x.sharding, sharded) == expected
  assert any(("fsdp", "seq") in s.spec for s in jax.tree.leaves(expected))
  jax.tree.map(np.testing.assert_array_equal, sharded, params)


def test_bfloat16_import_and_export(exported, tmp_path):
  cfg, params, folder = exported
  cfg16, params16 = import_hf(folder, dtype="bfloat16")
  assert cfg16.model.param_dtype == cfg16.model.compute_dtype == "bfloat16"
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)), params16, params)
  export_hf(params16, replace(cfg16, export=dict(dtype="bfloat16")), str(tmp_path))
  with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
  assert json.load(open(tmp_path / "config.json"))["dtype"] == "bfloat16"


def test_export_refuses_a_file_or_a_folder_that_is_not_empty_naming_it(exported, tmp_path):
  cfg, params, _ = exported
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(ConfigError, match=rf"export.out_dir='{tmp_path}' is not empty \(it holds "
                                        r"notes.txt\); .* set export.overwrite=true"):
    export_hf(params, cfg, str(tmp_path))
  with pytest.raises(ConfigError, match=rf"export.out_dir='{tmp_path}/notes.txt' is a file"):
    export_hf(params, cfg, str(tmp_path / "notes.txt"))
  assert os.listdir(tmp_path) == ["notes.txt"]


def test_export_files_get_the_usual_modes_and_this_model_s_generation_config(exported, tmp_path):
  """Modes follow the umask as `open`'s do (safetensors alone writes 0600). Overwriting an
  earlier export replaces its generation config and keeps files that are not the export's."""
  cfg, params, _ = exported
  out = tmp_path / "hf"
  umask = os.umask(0o027)
  try:
    export_hf(params, cfg, str(out))
  finally:
    os.umask(umask)
  for name in ("model.safetensors", "config.json", "generation_config.json"):
    assert oct(os.stat(out / name).st_mode & 0o777) == oct(0o640), name
  (out / "generation_config.json").write_text('{"eos_token_id": 2}')  # another model's
  (out / "tokenizer.json").write_text("{}")
  export_hf(params, replace(cfg, export=dict(overwrite=True)), str(out))
  assert json.loads((out / "generation_config.json").read_text()) == dict(
      bos_token_id=256, eos_token_id=257, pad_token_id=258)  # data.tokenizer=byte
  assert (out / "tokenizer.json").read_text() == "{}"


@pytest.mark.parametrize("seq_len, expected", [(64, 2048), (4096, 4096)])
def test_export_keeps_the_imported_model_s_context_unless_the_run_trained_longer(
    exported, tmp_path, seq_len, expected):
  """A model imported with max_position_embeddings=2048 and fine-tuned at L=64 still claims
  2048 (export wrote 64 before); one trained at 4096 claims 4096."""
  cfg, params, folder = exported
  source = tmp_path / "source"
  hf = edit_config(folder, source)
  write_config(source, dict(hf, max_position_embeddings=2048))
  export_hf(params, replace(cfg, init_from=str(source), data=dict(seq_len=seq_len)),
            str(tmp_path / "hf"))
  assert json.loads((tmp_path / "hf" / "config.json").read_text())[
      "max_position_embeddings"] == expected


def test_legacy_rope_theta_config_imports_alike(exported, tmp_path):
  """transformers 4.x files: top-level rope_theta, rope_scaling null, no head_dim."""
  cfg, _, folder = exported
  hf = edit_config(folder, tmp_path)
  hf.pop("rope_parameters")
  hf.pop("head_dim")
  hf.update(rope_theta=cfg.model.rope_theta, rope_scaling=None)
  write_config(tmp_path, hf)
  assert import_hf(str(tmp_path))[0].model == cfg.model


def test_init_from_checks_the_model_shapes(exported):
  cfg, params, folder = exported
  same = params_from_hf(replace(cfg, init_from=folder))
  jax.tree.map(np.testing.assert_array_equal, same, params)
  with pytest.raises(ConfigError, match=r"n_layers \(folder 2, config 3\).*d_ff"):
    params_from_hf(replace(cfg, init_from=folder, model=dict(n_layers=3, d_ff=32)))


def test_init_from_checks_the_expert_shapes(exported_moe):
  """With experts, their count and width fix the shapes; the dense d_ff does not."""
  cfg, folder = exported_moe
  params_from_hf(replace(cfg, init_from=folder, model=dict(d_ff=32)))
  with pytest.raises(ConfigError, match=r"moe_experts \(folder 4, config 8\); moe_d_ff "
                                        r"\(folder 16, config 32\)"):
    params_from_hf(replace(cfg, init_from=folder, model=dict(moe_experts=8, moe_d_ff=0,
                                                             d_ff=32)))


def edit_config(folder, tmp_path) -> dict:
  shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
  return json.load(open(tmp_path / "config.json"))


def write_config(tmp_path, hf: dict) -> None:
  (tmp_path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), r"model_type='gpt2' is not supported"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(rope_parameters={"rope_type": "ntk", "factor": 4.0}),
     r"rope_parameters has rope_type='ntk'; bdlm_jax implements \['default', 'linear'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -2.0}),
     r"rope_parameters has factor=-2.0; it must be a number > 0"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     r"rope_parameters \(rope_type 'llama3'\) needs low_freq_factor, high_freq_factor"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     r"rotates part of the head, which this family does not"),
    (dict(intermediate_size=48), r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 32\), "
                                 r"but config.json implies \(48, 32\)"),
])
def test_unsupported_or_inconsistent_config_is_a_config_error(exported, tmp_path, change, message):
  hf = edit_config(exported[2], tmp_path)
  write_config(tmp_path, {**hf, **change})
  with pytest.raises(ConfigError, match=message):
    import_hf(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be >= 1"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(moe_intermediate_size=12), r"'model.layers.0.mlp.experts.0.gate_proj.weight' has "
                                     r"shape \(16, 32\), but config.json implies \(12, 32\)"),
])
def test_unsupported_qwen3_moe_config_is_a_config_error(exported_moe, tmp_path, change, message):
  hf = edit_config(exported_moe[1], tmp_path)
  write_config(tmp_path, {**hf, **change})
  with pytest.raises(ConfigError, match=message):
    import_hf(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50.0 is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear"},
                           "sliding_attention": {"rope_type": "default"}}),
     r"rope_parameters.full_attention \(rope_type 'linear'\) needs factor"),
    (dict(rope_parameters=None, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                               "beta": 2}),
     r"rope_scaling has the keys \['beta'\], which it does not take"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     r"layer_types has the unsupported type\(s\) \['chunked_attention'\]"),
    (dict(hidden_activation="relu"), r"hidden_activation='relu' is not supported"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True is not supported"),
])
def test_unsupported_gemma3_config_is_a_config_error(exported_gemma3, tmp_path, change, message):
  hf = edit_config(exported_gemma3[1], tmp_path)
  write_config(tmp_path, {**hf, **change})
  with pytest.raises(ConfigError, match=message):
    import_hf(str(tmp_path))


def test_missing_tensor_is_named(exported, tmp_path):
  edit_config(exported[2], tmp_path)
  weights = safetensors.numpy.load_file(tmp_path / "model.safetensors")
  del weights["model.layers.1.self_attn.k_norm.weight"]
  safetensors.numpy.save_file(weights, tmp_path / "model.safetensors")
  with pytest.raises(ConfigError, match=r"'model.layers.1.self_attn.k_norm.weight' is missing"):
    import_hf(str(tmp_path))


def test_missing_folder_or_config_json(exported, tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    import_hf(str(tmp_path / "nowhere"))
  edit_config(exported[2], tmp_path)
  os.remove(tmp_path / "config.json")
  with pytest.raises(ConfigError, match="has no config.json"):
    import_hf(str(tmp_path))


FILL = [f"<extra_{i}>" for i in range(49)]  # with 3 specials and CORPUS' 10 words: 62 ids
MASK_CASES = {  # tokenizer specials -> the [MASK] id import_hf picks, and the vocab size
    "its mask token": (["[UNK]", "</s>", "[MASK]"], 2, 64),
    "a row beyond the tokenizer": (["[UNK]", "</s>", "[PAD]"], 13, 64),
    "a reserved placeholder": (["[UNK]", "</s>", "<|reserved_special_token_0|>", *FILL,
                                "<extra_a>", "<extra_b>"], 2, 64),
    "a new row": (["[UNK]", "</s>", "[PAD]", *FILL, "<extra_a>", "<extra_b>"], 64, 65),
}


@pytest.mark.parametrize("case", MASK_CASES)
def test_import_picks_a_mask_id_no_text_encodes_to(exported, tmp_path, case):
  from bdlm_jax.data.tokenizers import HFTokenizer, check_mask_id
  from tests.data.conftest import save_word_level
  specials, mask, vocab = MASK_CASES[case]
  cfg0, params0, folder = exported
  hf = edit_config(folder, tmp_path)
  write_config(tmp_path, {k: v for k, v in hf.items() if k != "bdlm_mask_token_id"})
  tokenizer = HFTokenizer(save_word_level(tmp_path / "tokenizer.json", specials))
  assert tokenizer.vocab_size <= cfg0.model.vocab_size == 64
  cfg, params = import_hf(str(tmp_path))
  assert (cfg.objective.mask_token_id, cfg.model.vocab_size) == (mask, vocab)
  assert cfg.data.tokenizer == str(tmp_path)
  check_mask_id(tokenizer, cfg.data, cfg.model.vocab_size, mask)  # what training checks
  embed, embed0 = (np.asarray(p["embed"]["embedding"]) for p in (params, params0))
  np.testing.assert_array_equal(embed[:64], embed0)
  if vocab == 65:  # the new row starts as the mean row, in the embedding and the head
    np.testing.assert_allclose(embed[64], embed0.mean(0), rtol=1e-5, atol=1e-6)
    head, head0 = (np.asarray(p["lm_head"]["kernel"]) for p in (params, params0))
    np.testing.assert_allclose(head[:, 64], head0.mean(1), rtol=1e-5, atol=1e-6)


def test_init_from_fills_a_larger_vocabulary_with_the_mean_row(exported):
  cfg, params, folder = exported
  grown = params_from_hf(replace(cfg, init_from=folder, model=dict(vocab_size=66)))
  embed, embed0 = np.asarray(grown["embed"]["embedding"]), np.asarray(params["embed"]["embedding"])
  np.testing.assert_array_equal(embed[:64], embed0)
  np.testing.assert_allclose(embed[64:], np.stack([embed0.mean(0)] * 2), rtol=1e-5, atol=1e-6)
  with pytest.raises(ConfigError, match=r"vocab_size \(folder 64, config 32\)"):
    params_from_hf(replace(cfg, init_from=folder, model=dict(vocab_size=32),
                           objective=dict(mask_token_id=31)))


# Gemma 4 and DiffusionGemma (docs/gemma4.md): experts beside a dense MLP, K = V on global
# layers with their own head dim and K/V heads, proportional RoPE on a quarter of their
# frequencies, a 5:1 pattern whose last layer HF forces global (a scanned period and a
# remainder), a window shorter than the tokens.
GEMMA4_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                   num_global_key_value_heads=1, sliding_window=5, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=16, final_logit_softcapping=30.0)
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8)


DIFFUSION_GENERATION = dict(eos_token_id=[1, 60, 50], max_new_tokens=128, max_denoising_steps=24,
                            t_min=0.3, t_max=0.9, sampler_config=dict(entropy_bound=0.2))


def gemma4_reference_logits(model, tokens) -> np.ndarray:
  """Gemma 4's causal logits; DiffusionGemma's encoder pass (its causal stream, as
  `DiffusionGemmaModel` runs it before the canvas) through the LM head and soft cap."""
  import torch
  if type(model).__name__ != "DiffusionGemmaForBlockDiffusion":
    return torch_logits(model, tokens)
  with torch.no_grad():
    h = model.model.encoder(input_ids=torch.as_tensor(tokens)).last_hidden_state
    cap = model.final_logit_softcapping
    return (torch.tanh(model.lm_head(h).float() / cap) * cap).numpy()


@pytest.fixture(scope="module", params=["gemma4_text", "diffusion_gemma"])
def gemma4_model(request, tmp_path_factory) -> HFModel:
  """A random Gemma 4 text or DiffusionGemma model saved to a folder. Weights are far from
  their init values, the per-layer `layer_scalar` buffers too (DiffusionGemma's encoder and
  decoder copies alike); q/k norm weights are near 0.35, since Gemma 4 leaves attention
  logits unscaled: sharp attention would amplify float32 rounding past the tolerance."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  if request.param == "gemma4_text":
    config = transformers.Gemma4TextConfig(**GEMMA4_TEXT, attention_k_eq_v=True,
                                           enable_moe_block=True, hidden_size_per_layer_input=0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  else:  # as released: text attention is causal, bidirectional only among image tokens
    config = transformers.DiffusionGemmaConfig(
        text_config=dict(GEMMA4_TEXT, use_bidirectional_attention="vision"),
        vision_config=TINY_VISION)
    model = transformers.DiffusionGemmaForBlockDiffusion._from_config(
        config, attn_implementation="eager")
  model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      center = (0.35 if "q_norm" in name or "k_norm" in name else
                1.0 if name.endswith(("norm.weight", "scale")) else 0.0)
      p.copy_(center + (0.5 if "router.proj" in name else 0.15) * torch.randn_like(p))
    scalars = {}
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        layer = int(name.split("layers.")[1].split(".")[0])
        b.copy_(scalars.setdefault(layer, 0.75 + 0.5 * torch.rand(1)))
  folder = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(folder)
  if request.param == "diffusion_gemma":  # the IT release's kind: an EOS list, sampler settings
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf
    hf.DiffusionGemmaGenerationConfig(**{
        **DIFFUSION_GENERATION, "sampler_config": hf.EntropyBoundSamplerConfig(
            **DIFFUSION_GENERATION["sampler_config"])}).save_pretrained(folder)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
  return HFModel(folder, model, tokens, gemma4_reference_logits(model, tokens))


@pytest.mark.slow
def test_gemma4_import_gives_the_logits_of_transformers(gemma4_model):
  """The causal logits through `ar_logits`; the features read from config.json; the
  vocabulary of a DiffusionGemma is the folder's (no [MASK] row), its vision tower left out
  with a warning that names it."""
  diffusion = "diffusion" in gemma4_model.folder
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cfg, params = import_hf(gemma4_model.folder)
  said = [str(w.message) for w in caught]
  assert any("vision tower" in s and "model.encoder.vision_tower." in s for s in said) == diffusion
  assert not any("ignoring tensors" in s for s in said), said
  m = cfg.model
  assert (m.layer_pattern, m.last_layer_global) == ("local,local,local,local,local,global", True)
  assert (m.global_head_dim, m.global_n_kv_heads, m.attention_k_eq_v) == (16, 1, True)
  assert (m.global_partial_rotary_factor, m.rope_theta, m.rope_local_theta) == (0.25, 1e6, 1e4)
  assert (m.moe_experts, m.moe_top_k, m.moe_d_ff, m.self_conditioning) == (4, 2, 16, diffusion)
  assert m.vocab_size == 64 + (not diffusion)
  if diffusion:  # its own objective, on canvases of the folder's canvas_length; its sampler
    assert (cfg.objective.name, cfg.objective.block_size) == ("diffusiongemma", 256)
    o = cfg.sample
    assert (o.eos_ids, o.max_new_tokens, o.denoising_steps, o.t_min, o.t_max,
            o.entropy_bound) == ("1,60,50", 128, 24, 0.3, 0.9, 0.2)
  assert params["global_layers"]["attn"]["k_proj"]["kernel"].shape == (2, 32, 16)
  assert "v_proj" not in params["global_layers"]["attn"]
  err = np.abs(jax_logits(params, cfg, gemma4_model.tokens)[..., :64] - gemma4_model.logits).max()
  assert err < TOL, f"max abs logit error {err}"
  flat = replace(cfg, model=dict(global_partial_rotary_factor=1.0))  # every frequency rotated
  err = np.abs(jax_logits(params, flat, gemma4_model.tokens)[..., :64] - gemma4_model.logits).max()
  assert err > 1000 * TOL, f"partial RoPE too weak to test: full RoPE errs by {err}"


def test_gemma4_export_loads_as_the_same_class_and_round_trips(gemma4_model, tmp_path):
  """transformers loads the export as the class it came from (DiffusionGemma with the
  imported folder's vision tower), with the same logits; importing it again gives the same
  config and params."""
  import transformers
  cfg, params = import_hf(gemma4_model.folder)
  out = str(tmp_path / "export")
  export_hf(params, cfg, out, vision_from=gemma4_model.folder)
  cls = type(gemma4_model.torch_model)
  loaded = getattr(transformers, cls.__name__).from_pretrained(out, attn_implementation="eager")
  assert type(loaded) is cls
  err = np.abs(gemma4_reference_logits(loaded, gemma4_model.tokens)[..., :64]
               - gemma4_model.logits).max()
  assert err < TOL, f"max abs logit error {err}"
  if cfg.model.self_conditioning:
    ours, theirs = (dict(m.named_parameters()) for m in (loaded, gemma4_model.torch_model))
    for name in [n for n in theirs if "vision" in n] + ["model.decoder.self_conditioning."
                                                        "gate_proj.weight"]:
      np.testing.assert_array_equal(ours[name].detach().numpy(), theirs[name].detach().numpy())
    # the source's generation config and text attention rule, carried over
    generation = [json.load(open(os.path.join(f, "generation_config.json")))
                  for f in (out, gemma4_model.folder)]
    assert generation[0] == generation[1]
    assert loaded.config.text_config.use_bidirectional_attention == "vision"
  cfg2, params2 = import_hf(out)
  assert cfg2.model == cfg.model and cfg2.sample == cfg.sample
  jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("gemma4_model", ["diffusion_gemma"], indirect=True)
def test_canvas_logits_equal_diffusion_gemma_s(gemma4_model):
  """`canvas_logits` against `DiffusionGemmaForBlockDiffusion(input_ids=prompt,
  decoder_input_ids=canvas, self_conditioning_logits=...)`: the first denoising step (no
  logits) and a later one (logits given); a prompt of 13 tokens (not whole blocks) and longer
  than the window, so that the canvas's local layers see only its last window - 1 tokens."""
  import torch
  cfg, params = import_hf(gemma4_model.folder)
  rng = np.random.default_rng(5)
  prompt, canvas = rng.integers(0, 64, (2, 13)), rng.integers(0, 64, (2, 8))
  logits = 3 * rng.normal(size=(2, 8, 64)).astype(np.float32)
  run = jax.jit(lambda p, *a: canvas_logits(p, cfg, prompt, canvas, *a))
  for given in (None, logits):
    got = np.asarray(run(params) if given is None else run(params, given))
    with torch.no_grad():
      want = gemma4_model.torch_model(
          input_ids=torch.as_tensor(prompt), decoder_input_ids=torch.as_tensor(canvas),
          self_conditioning_logits=None if given is None else torch.as_tensor(given)).logits
    err = np.abs(got - want.numpy()).max()
    assert err < TOL, f"self-conditioning logits {given is not None}: max abs error {err}"
  assert np.abs(got - np.asarray(run(params))).max() > 1000 * TOL  # the logits matter


@pytest.mark.parametrize("gemma4_model", ["diffusion_gemma"], indirect=True)
def test_diffusion_gemma_export_needs_its_source_folder(gemma4_model, tmp_path):
  """Without the folder it came from, a DiffusionGemma export would name a random vision
  tower: refused, unless export.toy_vision asks for one; `init_from` is that folder."""
  cfg, params = import_hf(gemma4_model.folder)
  with pytest.raises(ConfigError, match=r"needs the vision tower .* set init_from"):
    export_hf(params, cfg, str(tmp_path / "a"))
  export_hf(params, replace(cfg, export=dict(toy_vision=True)), str(tmp_path / "b"))
  export_hf(params, replace(cfg, init_from=gemma4_model.folder), str(tmp_path / "c"))
  assert json.load(open(tmp_path / "c" / "config.json"))["vision_config"] == json.load(
      open(os.path.join(gemma4_model.folder, "config.json")))["vision_config"]
  names = safetensors.numpy.load_file(str(tmp_path / "c" / "model.safetensors"))
  assert any(n.startswith("model.encoder.vision_tower.") for n in names)


@pytest.mark.parametrize("gemma4_model", ["diffusion_gemma"], indirect=True)
def test_decoder_layer_scalars_that_differ_are_named(gemma4_model, tmp_path):
  """transformers' canvas pass reads the decoder's `layer_scalar` copies, ours the encoder's:
  a folder whose copies differ imports with a warning naming them."""
  folder = shutil.copytree(gemma4_model.folder, tmp_path / "edited")
  files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
  assert len(files) == 1
  tensors = safetensors.numpy.load_file(str(folder / files[0]))
  name = "model.decoder.layers.2.layer_scalar"
  tensors[name] = tensors[name] * 1.5
  safetensors.numpy.save_file(tensors, str(folder / files[0]), metadata={"format": "pt"})
  with pytest.warns(UserWarning, match=r"model.decoder.layers.2.layer_scalar \(\|difference\|"):
    import_hf(str(folder))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the release's equal copies: no such warning
    try:
      import_hf(gemma4_model.folder)
    except UserWarning as e:
      assert "layer_scalar" not in str(e)


@pytest.fixture(scope="module")
def exported_gemma4(tmp_path_factory):
  """(cfg, folder): a random Gemma 4-style model written by export_hf."""
  cfg = replace(Config(), model=dict(
      vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
      qk_norm=True, post_norms=True, scale_embeddings=True, mlp_activation="gelu_tanh",
      layer_pattern="local,global", last_layer_global=True, sliding_window=4,
      rope_local_theta=1e4, query_pre_attn_scalar=1, global_head_dim=16, v_norm=True,
      layer_scalar=True, global_partial_rotary_factor=0.5), objective=dict(mask_token_id=63))
  folder = str(tmp_path_factory.mktemp("exported_gemma4"))
  export_hf(init_params(cfg, jax.random.key(0)), cfg, folder)
  return cfg, folder


def test_gemma4_dense_export_round_trips_without_transformers(exported_gemma4):
  cfg, folder = exported_gemma4
  assert json.load(open(os.path.join(folder, "config.json")))["enable_moe_block"] is False
  assert import_hf(folder)[0].model == cfg.model


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size_per_layer_input=256), r"hidden_size_per_layer_input=256 is not supported "
                                            r"\(per-layer input embeddings\)"),
    (dict(num_kv_shared_layers=2), r"num_kv_shared_layers=2 is not supported"),
    (dict(use_bidirectional_attention="all"), r"use_bidirectional_attention='all' is not supp"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0},
                           "sliding_attention": {"rope_type": "default"}}),
     r"rope_parameters.full_attention=.* is not supported"),
    (dict(per_layer_config={"0": {"head_dim": 16}}), r"per_layer_config=.* is not supported"),
])
def test_unsupported_gemma4_config_is_a_config_error(exported_gemma4, tmp_path, change, message):
  hf = edit_config(exported_gemma4[1], tmp_path)
  write_config(tmp_path, {**hf, **change})
  with pytest.raises(ConfigError, match=message):
    import_hf(str(tmp_path))


@pytest.mark.parametrize("model, message", [
    (dict(layer_scalar=True), r"gemma4_text also needs model.qk_norm=true; .*model.v_norm=true"),
    (dict(self_conditioning=True, qk_norm=True, post_norms=True, scale_embeddings=True,
          v_norm=True, layer_scalar=True, query_pre_attn_scalar=1),
     r"diffusion_gemma also needs experts, model.attention_k_eq_v=true"),
])
def test_export_refuses_a_gemma4_model_its_family_cannot_hold(tmp_path, model, message):
  cfg = replace(Config(), model=model)
  with pytest.raises(ConfigError, match=message):
    export_hf(abstract_params(cfg), cfg, str(tmp_path))


def test_a_part_of_a_fused_hf_tensor_reads_any_slice_of_ours():
  """Gemma 4's `experts.gate_up_proj` [E, 2F, D]: our gate and up [E, D, F] are its two
  halves, transposed; a device's slice of ours (any axis sharded) reads only its rows."""
  from bdlm_jax.checkpoint.hf_tensor import Tensor
  e, f, d = 4, 6, 8
  hf = np.random.default_rng(3).normal(size=(e, 2 * f, d))
  for part, ours in enumerate((hf[:, :f].swapaxes(1, 2), hf[:, f:].swapaxes(1, 2))):
    t = Tensor("experts.gate_up_proj", ("mlp", "up_proj"), True, 0, part=(part, 2))
    assert t.hf_shape(ours.shape) == hf.shape
    for index in [(slice(None),) * 3, (slice(1, 3), slice(None), slice(2, 4)),
                  (slice(None), slice(4, 8), slice(0, 3))]:
      np.testing.assert_array_equal(np.swapaxes(hf[t.hf_index(index, ours.shape)], -1, -2),
                                    ours[index])
