"""The served DFlash2 drafter folder (checkpoint/hf_drafter.py) against the seed's own code
(Turbo-dLLM 0.1.6, `dllm_parallel`): its `validate-export` and `validate-vllm` gates accept
our export, and its loader (`DFlashBackboneExecutor.build_model`) reading the folder gives our
drafter's block logits and the candidate selector's picks (f32, CPU; the seed's FA4 attention
replaced by a dense one written from its masks). Skipped where torch or the seed is not
installed."""

import functools
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from bdlm_jax import ConfigError, draft_logits, draft_proposals, init_params
from bdlm_jax.checkpoint.hf_drafter import (CONFIG_FILE, PROVENANCE_FILE, WEIGHTS_FILE,
                                            drafter_tensors, export_drafter, load_drafter)
from bdlm_jax.configure import replace
from bdlm_jax.models.transformer import head_logits
from bdlm_jax.params import merge
from tests.objectives.test_dflash import A, B, L
from tests.objectives.test_dflash2 import _cfg2, _params

torch = pytest.importorskip("torch")
executor = pytest.importorskip("dllm_parallel.core.models.backbones.dflash.executor")
vllm_dflash = pytest.importorskip("dllm_parallel.serving.vllm_dflash")
seed_attention = pytest.importorskip("dllm_parallel.core.attention.dflash_attention")
seed_objective = pytest.importorskip("dllm_parallel.core.objectives.dflash")

S, LAYERS = 2, "1,2"  # two target layers: fc's input is layer-major


def _cfg():
  """The DFlash2 test drafter (window, causal own block, multiplier, soft cap, selector,
  convolutions) over two target layers' features, read precomputed."""
  return replace(_cfg2(), drafter=dict(features="precomputed", target_layers=LAYERS))


@functools.cache
def _inputs():
  rng = np.random.default_rng(7)
  cfg = _cfg()
  tokens = rng.integers(0, 250, (S, L))
  feats = rng.normal(size=(S, L, 2, cfg.model.d_model)).astype(np.float32)
  return tokens, feats


@functools.cache
def _exported(folder):
  cfg = replace(_cfg(), export=dict(out_dir=folder))
  params = _params(cfg)
  export_drafter(params, cfg, folder, step=7, source="runs/tiny")
  return cfg, params


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("drafter") / "served")
  return (folder, *_exported(folder))


def test_the_export_holds_the_served_files_and_passes_the_seeds_gates(exported):
  folder, cfg, _ = exported
  assert sorted(os.listdir(folder)) == sorted([CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE])
  executor.validate_sglang_dflash2_export(folder, expected_block_size=B)
  assert vllm_dflash.validate_vllm_dflash2_export(
      folder, expected_block_size=B)["num_speculative_tokens"] == B - 1
  config = json.load(open(os.path.join(folder, CONFIG_FILE)))
  model = executor.DFlashModelConfig.from_mapping(config)
  # capture ids as written; the seed's canonical ids one higher; its defaults overridden
  assert config["dflash_config"]["target_layer_ids"] == [1, 2]
  assert model.target_layer_ids == (2, 3)
  assert (model.output_multiplier, model.final_logit_softcapping) == (
      cfg.model.output_multiplier, cfg.model.logit_softcap)
  assert not model.sliding_window_non_causal and model.sliding_window == cfg.drafter.window
  assert model.mask_token_id == cfg.objective.mask_token_id
  names = set(safetensors.numpy.load_file(os.path.join(folder, WEIGHTS_FILE)))
  assert names == {t.name for t in drafter_tensors(cfg.drafter.n_layers)}
  assert not names & {"embed_tokens.weight", "lm_head.weight", "verifier_norm.weight"}
  provenance = json.load(open(os.path.join(folder, PROVENANCE_FILE)))
  assert (provenance["checkpoint_step"], provenance["weights"]["tensor_count"]) == (7, len(names))


def test_the_seeds_gate_refuses_an_export_whose_weights_changed(exported, tmp_path):
  folder = exported[0]
  copy = tmp_path / "copy"
  copy.mkdir()
  for name in os.listdir(folder):
    (copy / name).write_bytes(open(os.path.join(folder, name), "rb").read())
  tensors = safetensors.numpy.load_file(str(copy / WEIGHTS_FILE))
  tensors["norm.weight"] = tensors["norm.weight"] + 1
  safetensors.numpy.save_file(tensors, str(copy / WEIGHTS_FILE))
  with pytest.raises(RuntimeError, match="SHA-256"):
    executor.validate_sglang_dflash2_export(str(copy), expected_block_size=B)


def test_a_drafter_without_the_dflash2_parts_is_refused(tmp_path):
  cfg = replace(_cfg(), objective=dict(selector_rank=0))
  with pytest.raises(ConfigError, match="objective.selector_rank=0"):
    export_drafter({}, cfg, str(tmp_path / "x"), step=0)


def _dense_attention(*, query, local_key, local_value, global_key, global_value,
                     local_attn_mask, global_attn_mask, scale, global_intervals=None, **_):
  """The seed's DFlash attention, dense: slot j of anchor a sees the context rows in
  [max(document start, a + j - W + 1), a) and its own block (slots <= j when causal)."""
  s, q, h, hd = query.shape
  b = local_attn_mask.block_size
  rep = h // local_key.shape[2]
  pos = (torch.cat([torch.arange(lo, hi) for lo, hi in global_intervals])
         if global_intervals else torch.arange(global_key.shape[1]))
  starts = global_attn_mask.context_starts.long()[..., None]  # [S, A, 1]
  stops = global_attn_mask.context_stops.long()[..., None]
  lo = starts.expand(-1, -1, b)
  if global_attn_mask.sliding_window:
    lo = torch.maximum(lo, stops + torch.arange(b) - global_attn_mask.sliding_window + 1)
  ctx_ok = (pos >= lo[..., None]) & (pos < stops[..., None])  # [S, A, B, C]
  own_ok = (torch.ones(b, b, dtype=torch.bool).tril() if local_attn_mask.causal
            else torch.ones(b, b, dtype=torch.bool))
  qb = query.reshape(s, -1, b, h, hd)
  gk, gv = (x.repeat_interleave(rep, 2) for x in (global_key, global_value))
  lk, lv = (x.repeat_interleave(rep, 2).reshape(s, -1, b, h, hd) for x in (local_key,
                                                                           local_value))
  ctx = torch.einsum("sajhd,schd->sajhc", qb, gk) * scale
  own = torch.einsum("sajhd,sakhd->sajhk", qb, lk) * scale
  ctx = ctx.masked_fill(~ctx_ok[:, :, :, None], -torch.inf)
  own = own.masked_fill(~own_ok[None, None, :, None], -torch.inf)
  p = torch.softmax(torch.cat([ctx, own], -1), -1)
  c = gk.shape[1]
  out = (torch.einsum("sajhc,schd->sajhd", p[..., :c], gv)
         + torch.einsum("sajhk,sakhd->sajhd", p[..., c:], lv))
  return out.reshape(s, q, h, hd)


def _verifier_folder(params, cfg, folder):
  """The verifier tensors the seed's loader reads beside the drafter: its embedding, head and
  final norm, from our frozen target."""
  model = merge(cfg, params)
  head = np.asarray(head_logits(model.head, np.eye(cfg.model.d_model)[None], 0.0)[0]).T
  os.makedirs(folder)
  safetensors.numpy.save_file({
      "model.embed_tokens.weight": np.asarray(params["target"]["embed"]["embedding"]),
      "lm_head.weight": np.ascontiguousarray(head, np.float32),
      "model.norm.weight": np.asarray(params["target"]["final_norm"]["scale"])},
      os.path.join(folder, "model.safetensors"))
  return folder


def seed_drafter(folder, params, cfg, tmp_path, monkeypatch):
  """The seed's DFlash2Model as its loader builds it from `folder` (f32, CPU, dense
  attention)."""
  monkeypatch.setattr(seed_attention, "dflash_attention", _dense_attention)
  config = json.load(open(os.path.join(folder, CONFIG_FILE)))
  config["verifier_id"] = _verifier_folder(params, cfg, str(tmp_path / "verifier"))
  return executor.DFlashBackboneExecutor().build_model(
      model_id=folder, revision=None, config=config, runtime=None, dtype=torch.float32,
      device="cpu", trust_remote_code=False).eval()


def seed_block_logits(model, cfg, tokens, feats, anchors):
  """The seed's unary logits [S, A, B, V] and its selector's greedy picks [S, A, B - 1] at
  `anchors` [S, A] (one document a sequence)."""
  o = cfg.objective
  anchors = torch.tensor(np.asarray(anchors), dtype=torch.long)
  ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
  blocks = anchors[..., None] + torch.arange(B)
  draft = torch.full((S, A, B), o.mask_token_id, dtype=torch.long)
  draft[..., 0] = ids.gather(1, anchors)
  valid = torch.ones(S, A, dtype=torch.bool)
  batch = seed_objective.DFlashObjectiveBatch(
      anchor_positions=anchors, anchor_valid=valid, block_positions=blocks,
      teacher_source_positions=blocks, target_token_positions=blocks,
      draft_input_ids=draft.reshape(S, -1), supervised_mask=torch.ones(S, A * B, dtype=bool),
      position_weights=torch.ones(S, A * B), document_starts=torch.zeros(S, A, dtype=torch.int32),
      context_stops=anchors.to(torch.int32), global_anchor_count=A)
  with torch.no_grad():
    hidden = model(target_hidden_states=torch.tensor(np.asarray(feats)).reshape(S, L, -1),
                   teacher_hidden_states=None, input_ids=ids,
                   position_ids=torch.arange(L).expand(S, L), objective=batch,
                   compute_teacher=False).hidden_states.reshape(S, A, B, -1)
    logits = model.transform_unary_logits(model.lm_head(hidden))
    unary, cand = logits[:, :, 1:].topk(o.selector_top_k, -1)
    flat = lambda x: x.reshape(S * A, *x.shape[2:])
    picks = model.candidate_selector.greedy_path(
        candidate_ids=flat(cand), unary_logits=flat(unary), hidden_states=flat(hidden[:, :, 1:]),
        anchor_token_ids=flat(draft[..., 0]))
  return logits.numpy(), picks.reshape(S, A, B - 1).numpy()


def test_the_seeds_loader_reading_the_export_gives_our_logits_and_picks(exported, tmp_path,
                                                                        monkeypatch):
  folder, cfg, params = exported
  tokens, feats = _inputs()
  ours, batch = draft_logits(params, cfg, tokens, context=feats)
  picks, _ = draft_proposals(params, cfg, tokens, context=feats)
  anchors = np.asarray(batch.pos[:, :A * B:B])  # slot 0 of each draft block
  model = seed_drafter(folder, params, cfg, tmp_path, monkeypatch)
  logits, seed_picks = seed_block_logits(model, cfg, tokens, feats, anchors)
  ours = np.asarray(ours)
  rel = np.abs(logits - ours).max() / np.abs(ours).max()
  assert rel < 1e-4, rel
  assert (np.asarray(picks) == seed_picks).all()


# A drafter as the seed builds it, written by hand in its flat served layout: capture ids
# [0, 2], two sliding layers whose blocks are non-causal (said at the root only), its own mask
# token, multiplier and soft cap
SEED_CONFIG = dict(
    architectures=["DFlash2DraftModel"], model_type="qwen3", hidden_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=40, vocab_size=260, rms_norm_eps=1e-6, rope_theta=1e4,
    layer_types=["sliding_attention"] * 2, sliding_window=10, sliding_window_non_causal=True,
    dflash_config=dict(block_size=B, mask_token_id=257, target_layer_ids=[0, 2],
                       conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                       selector_top_k=16, output_multiplier=0.5,
                       final_logit_softcapping=5.0))
VERIFIER_ONLY = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                 "verifier_norm.weight", "t2d", "d2t")


def _seed_built(folder, config=SEED_CONFIG):
  """A random drafter built by the seed's classes and saved as its export saves one."""
  from dllm_parallel.core.models.backbones.dflash.dflash2 import DFlash2Model
  torch.manual_seed(0)
  model = DFlash2Model(executor.DFlashModelConfig.from_mapping(config),
                       attention_op=_dense_attention)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(p + 0.2 * torch.randn_like(p))  # the zero-initialised parts too
  state = {k: v.contiguous().numpy() for k, v in model.state_dict().items()
           if v is not None and k not in VERIFIER_ONLY}
  os.makedirs(folder)
  safetensors.numpy.save_file(state, os.path.join(folder, WEIGHTS_FILE))
  with open(os.path.join(folder, CONFIG_FILE), "w") as f:
    json.dump(config, f)
  return folder


def test_a_drafter_the_seed_built_starts_here_with_the_seeds_logits(tmp_path, monkeypatch):
  folder = _seed_built(str(tmp_path / "published"))
  cfg = replace(_cfg(), drafter=dict(init_from=folder))
  d, o, m = cfg.drafter, cfg.objective, cfg.model
  assert (d.n_layers, d.n_heads, d.n_kv_heads, d.d_ff, d.target_layers, d.window,
          d.sliding_causal) == (2, 4, 2, 40, "0,2", 10, False)
  assert (o.mask_token_id, o.selector_rank, o.selector_top_k, m.output_multiplier,
          m.logit_softcap) == (257, 4, 16, 0.5, 5.0)
  params = init_params(cfg, jax.random.key(3))
  params["drafter"] = load_drafter(cfg, params["drafter"])
  tokens, feats = _inputs()
  ours, batch = draft_logits(params, cfg, tokens, context=feats)
  anchors = np.asarray(batch.pos[:, :A * B:B])
  model = seed_drafter(folder, params, cfg, tmp_path, monkeypatch)
  logits, _ = seed_block_logits(model, cfg, tokens, feats, anchors)
  ours = np.asarray(ours)
  assert np.abs(logits - ours).max() / np.abs(ours).max() < 1e-4


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "mixes full and sliding"),
    (dict(attention_bias=True), "biases"),
    (dict(draft_vocab_size=100), "reduced draft vocabulary"),
    (dict(hidden_size=48), "does not fit the target"),
    (dict(is_causal=True), "causality fields disagree"),
])
def test_a_drafter_that_cannot_be_represented_is_refused(tmp_path, change, message):
  folder = tmp_path / "published"
  folder.mkdir()
  (folder / CONFIG_FILE).write_text(json.dumps({**SEED_CONFIG, **change}))
  with pytest.raises(ConfigError, match=message):
    replace(_cfg(), drafter=dict(init_from=str(folder)))


def test_root_target_layer_ids_are_the_seeds_canonical_ones(tmp_path):
  folder = tmp_path / "published"
  folder.mkdir()
  (folder / CONFIG_FILE).write_text(json.dumps({**SEED_CONFIG, "target_layer_ids": [2, 3]}))
  assert replace(_cfg(), drafter=dict(init_from=str(folder))).drafter.target_layers == "1,2"


def test_run_export_writes_a_drafter_run_and_init_from_reads_it_back(tmp_path):
  """`run.py --set mode=export` on a drafter's workdir writes the served folder, which the
  seed's gate accepts and `drafter.init_from` reads back: the same drafter, the same weights."""
  import run
  from bdlm_jax.checkpoint import Checkpointer
  from bdlm_jax.models.drafter import drafter_args
  from bdlm_jax.parallel.mesh import make_mesh
  from bdlm_jax.train import init_state
  cfg = _cfg()
  params = _params(cfg)
  config_file = tmp_path / "cfg.py"
  config_file.write_text(f"def get_config():\n  return {cfg.to_dict()!r}\n")
  workdir, out = str(tmp_path / "work"), str(tmp_path / "served")
  with Checkpointer(workdir, cfg, save_every=1, max_to_keep=1, async_save=False) as ckpt:
    ckpt.save(3, init_state(cfg, jax.random.key(0), make_mesh(cfg), params))
  assert run.main(["--config", str(config_file), "--workdir", workdir, "--set", "mode=export",
                   "--set", f"export.out_dir={out}"]) == 0
  executor.validate_sglang_dflash2_export(out, expected_block_size=B)
  back = replace(cfg, drafter=dict(init_from=out))
  assert drafter_args(back) == drafter_args(cfg)
  assert (back.objective, back.model) == (cfg.objective, cfg.model)
  assert back.drafter.target_layers == LAYERS
  loaded = load_drafter(back, init_params(back, jax.random.key(5))["drafter"])
  jax.tree.map(np.testing.assert_array_equal, loaded, params["drafter"])


@pytest.mark.slow  # the cheap sibling: test_run_export_writes_..._reads_it_back
def test_a_run_from_a_served_drafter_starts_from_its_weights(tmp_path):
  """What `train` starts a fresh drafter run from (`loop.starting_params`): the served
  drafter's weights beside the target `drafter.target` names (a Hugging Face folder, so a
  target without the multiplier and soft cap no family expresses)."""
  from bdlm_jax import export_hf, make_mesh
  from bdlm_jax.loop import starting_params
  cfg = replace(_cfg(), model=dict(output_multiplier=1.0, logit_softcap=0.0),
                drafter=dict(features=""))
  params = _params(cfg)
  folder, hf = str(tmp_path / "served"), str(tmp_path / "target")
  export_drafter(params, cfg, folder, step=1)
  export_hf(params["target"], replace(cfg, objective=dict(name="bd3lm")), hf)
  run = replace(cfg, drafter=dict(init_from=folder, target=hf))
  start = starting_params(run, jax.random.key(9), make_mesh(run))
  jax.tree.map(np.testing.assert_array_equal, start["drafter"], params["drafter"])
  jax.tree.map(np.testing.assert_array_equal, start["target"], params["target"])
