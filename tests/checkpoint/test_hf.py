"""Hugging Face import/export: parity with `transformers` (CPU PyTorch), round trips, mesh
placement, the export command, and one clear error per bad input."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import run
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf, params_from_hf
from bdlm_jax.config import Config, ConfigError, replace
from bdlm_jax.loss import ar_logits
from bdlm_jax.params import abstract_params
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.parallel.zero3 import zero3_shardings
from bdlm_jax.train import init_state

TOL = 1e-5
SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rope_theta=500.0, rms_norm_eps=1e-5)
CASES = {  # name: (model_type, tie_word_embeddings, vocab_size, save_pretrained max_shard_size)
    "llama_untied_sharded": ("llama", False, 300, "20KB"),
    "llama_tied": ("llama", True, 64, None),
    "qwen3_tied": ("qwen3", True, 128, None),
}


@dataclasses.dataclass
class HFModel:
  folder: str
  torch_model: object
  tokens: np.ndarray  # [2, 16]
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
  values (norm weights too), so that every mapping error shows in the logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model_type, tie, vocab, shard = CASES[request.param]
  config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      config_cls(vocab_size=vocab, tie_word_embeddings=tie, **SHAPES),
      attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.2 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 16))
  return HFModel(folder, model, tokens, torch_logits(model, tokens))


def test_import_gives_the_logits_of_transformers(hf_model):
  cfg, params = import_hf(hf_model.folder)
  hf = json.load(open(os.path.join(hf_model.folder, "config.json")))
  assert cfg.model.qk_norm == (hf["model_type"] == "qwen3")
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


def edit_config(folder, tmp_path) -> dict:
  shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
  return json.load(open(tmp_path / "config.json"))


def write_config(tmp_path, hf: dict) -> None:
  (tmp_path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), r"model_type='gpt2' is not supported"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"RoPE scaling .* not supported"),
    (dict(intermediate_size=48), r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 32\), "
                                 r"but config.json implies \(48, 32\)"),
])
def test_unsupported_or_inconsistent_config_is_a_config_error(exported, tmp_path, change, message):
  hf = edit_config(exported[2], tmp_path)
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
