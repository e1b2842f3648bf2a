"""A DFlash2 drafter in the folder SGLang and vLLM serve (docs/train_dflash.md, "Export"):
`config.json` (Qwen3-style, `architectures: ["DFlash2DraftModel"]`, `model_type: "qwen3"`,
the drafter's settings in a `dflash_config` section), one `model.safetensors` without the
verifier's embedding, head or final norm (a server takes those from the verifier), and
`training_export.json`, the weights' provenance with their sha256, as the seed's
`dllm dflash export` writes them (Turbo-dLLM 0.1.6, dflash/executor.py ~516-775).

Layer ids: `dflash_config.target_layer_ids` are *capture* ids, id i the output of verifier
layer i (Hugging Face's `hidden_states[i + 1]`), which is what `drafter.target_layers` holds;
the seed's recipes and its feature manifests use canonical ids, one higher (dflash/model.py
~274-285).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import safetensors.numpy

from bdlm_jax.checkpoint.hf_names import get_path, set_path
from bdlm_jax.checkpoint.out_dir import check_out_dir, make_out_dir, save_tensors, write_json
from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.drafter import TRAINED, drafter_model, target_layer_ids
from bdlm_jax.parallel.mesh import to_host

CONFIG_FILE, WEIGHTS_FILE, PROVENANCE_FILE = ("config.json", "model.safetensors",
                                              "training_export.json")
ARCHITECTURE, MODEL_TYPE = "DFlash2DraftModel", "qwen3"
# What the seed's validate-export accepts as the provenance file's format (executor.py ~541)
PROVENANCE_FORMAT = "dllm_parallel.dflash2_training_export.v1"


@dataclasses.dataclass(frozen=True)
class DrafterTensor:
  """One served tensor: `name`, from `path` under params['drafter'] (its `layer`'s slice of a
  stacked weight, None for an unstacked one), `transposed` for a Linear (flax [in, out],
  torch [out, in])."""
  path: tuple[str, ...]
  name: str
  layer: int | None = None
  transposed: bool = False


_TOP = ((("fc", "kernel"), "fc.weight", True),
        (("hidden_norm", "scale"), "hidden_norm.weight", False),
        (("final_norm", "scale"), "norm.weight", False),
        (("selector", "predecessor_codebook"), "candidate_selector.predecessor_codebook", False),
        (("selector", "successor_codebook"), "candidate_selector.successor_codebook", False),
        (("selector", "hidden_projection", "kernel"),
         "candidate_selector.hidden_projection.weight", True))
_PER_LAYER = (
    *((("layers", "attn", f"{p}_proj", "kernel"), f"self_attn.{p}_proj.weight", True)
      for p in "qkvo"),
    *((("layers", "attn", f"{p}_norm", "scale"), f"self_attn.{p}_norm.weight", False)
      for p in "qk"),
    *((("layers", "mlp", f"{p}_proj", "kernel"), f"mlp.{p}_proj.weight", True)
      for p in ("gate", "up", "down")),
    (("layers", "attn_norm", "scale"), "input_layernorm.weight", False),
    (("layers", "mlp_norm", "scale"), "post_attention_layernorm.weight", False),
    *((("convs", ours, "base_kernel"), f"{seed}.base_kernel", False)
      for ours, seed in (("attn", "attention_conv"), ("mlp", "mlp_conv"))),
    *((("convs", ours, "kernel_projection", "kernel"), f"{seed}.kernel_projection.weight", True)
      for ours, seed in (("attn", "attention_conv"), ("mlp", "mlp_conv"))))


def drafter_tensors(n_layers: int) -> list[DrafterTensor]:
  """Every tensor of a served DFlash2 drafter of `n_layers` layers (the seed's
  `_expected_dflash2_serving_shapes`, executor.py ~568-627), with where it lives here."""
  return [*(DrafterTensor(path, name, None, t) for path, name, t in _TOP),
          *(DrafterTensor(path, f"layers.{i}.{name}", i, t)
            for i in range(n_layers) for path, name, t in _PER_LAYER)]


def check_servable(cfg: Config) -> None:
  """The served DFlash2 format holds a drafter with block convolutions and the candidate
  selector, over its verifier's full vocabulary."""
  missing = [key for key, value in (("drafter.conv_taps", cfg.drafter.conv_taps),
                                    ("objective.selector_rank", cfg.objective.selector_rank))
             if not value]
  if missing:
    raise ConfigError(f"the served DFlash2 format needs block convolutions and the candidate "
                      f"selector; this drafter has {' and '.join(f'{k}=0' for k in missing)}")
  if cfg.drafter.conv_taps > cfg.objective.block_size:
    raise ConfigError(f"drafter.conv_taps={cfg.drafter.conv_taps} exceeds "
                      f"objective.block_size={cfg.objective.block_size}: not servable")


def served_config(cfg: Config) -> dict:
  """config.json of the drafter `cfg` trains: its layers at the root (Qwen3's keys, as SGLang's
  flat layout reads them), the DFlash2 settings in `dflash_config`. The own-block causality
  and the output multiplier are written out, in every spelling the seed reads, because its
  defaults differ from ours (causal; 1)."""
  d, m, o = drafter_model(cfg), cfg.model, cfg.objective
  sliding = bool(cfg.drafter.window)
  non_causal = sliding and not cfg.drafter.sliding_causal
  return dict(
      architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
      hidden_size=d.d_model, target_hidden_size=m.d_model, intermediate_size=d.d_ff,
      num_hidden_layers=d.n_layers, num_attention_heads=d.n_heads,
      num_key_value_heads=d.n_kv_heads, head_dim=d.head_dim, vocab_size=d.vocab_size,
      draft_vocab_size=d.vocab_size, rms_norm_eps=d.norm_eps, rope_theta=d.rope_theta,
      hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
      tie_word_embeddings=False, max_position_embeddings=cfg.data.seq_len,
      layer_types=[("sliding_attention" if sliding else "full_attention")] * d.n_layers,
      sliding_window=cfg.drafter.window or None, use_sliding_window=sliding,
      torch_dtype=str(np.dtype(jax.numpy.dtype(m.param_dtype))),
      block_size=o.block_size, sample_from_anchor=False,
      is_causal=not non_causal, sliding_window_non_causal=non_causal,
      dflash_config=dict(
          block_size=o.block_size, mask_token_id=o.mask_token_id,
          target_layer_ids=list(target_layer_ids(cfg)),
          conv_kernel_size=cfg.drafter.conv_taps, conv_group_size=cfg.drafter.conv_group_size,
          selector_rank=o.selector_rank, selector_top_k=o.selector_top_k,
          output_multiplier=m.output_multiplier,
          final_logit_softcapping=m.logit_softcap or None,
          attention_mode="gqa" if d.n_kv_heads < d.n_heads else "mha",
          causal=not non_causal))


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 23), b""):
      digest.update(chunk)
  return digest.hexdigest()


def export_drafter(params, cfg: Config, out_dir: str, step: int, source: str = "") -> None:
  """Writes the served folder of `params[TRAINED]` into a new or empty `out_dir`, in the
  weights' training dtype (`model.param_dtype`); `step` and `source` (the workdir) go into
  the provenance. Only process 0 writes."""
  check_servable(cfg)
  check_out_dir(out_dir, cfg.export.overwrite)
  dtype = jax.numpy.dtype(cfg.model.param_dtype)
  host, tensors = {}, {}
  for t in drafter_tensors(cfg.drafter.n_layers):
    if t.path not in host:  # a stacked weight is gathered once for all its layers
      host[t.path] = to_host(get_path(params[TRAINED], t.path)).astype(dtype)
    x = host[t.path] if t.layer is None else host[t.path][t.layer]
    tensors[t.name] = np.ascontiguousarray(np.swapaxes(x, -1, -2) if t.transposed else x)
  if jax.process_index() != 0:
    return
  make_out_dir(out_dir)
  weights = os.path.join(out_dir, WEIGHTS_FILE)
  save_tensors(tensors, weights)
  write_json(os.path.join(out_dir, CONFIG_FILE), served_config(cfg))
  write_json(os.path.join(out_dir, PROVENANCE_FILE), dict(
      format=PROVENANCE_FORMAT, verifier_id=cfg.drafter.target, checkpoint=source,
      checkpoint_step=step,
      weights=dict(path=WEIGHTS_FILE, bytes=os.path.getsize(weights), sha256=_sha256(weights),
                   tensor_count=len(tensors))))


def read_served_config(folder: str) -> dict:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"drafter.init_from={folder!r} has no {CONFIG_FILE} (a served DFlash2 "
                      f"drafter folder: {CONFIG_FILE}, {WEIGHTS_FILE})")
  with open(path) as f:
    return json.load(f)


def _canonical_minus_one(config: dict) -> list[int] | None:
  """Root `target_layer_ids` / `aux_hidden_state_layer_ids` are the seed's canonical ids
  (dflash/model.py ~274-285): one above ours."""
  for key in ("aux_hidden_state_layer_ids", "target_layer_ids"):
    if config.get(key):
      return [int(i) - 1 for i in config[key]]
  return None


def served_settings(cfg: Config) -> dict:
  """The config sections the served drafter `drafter.init_from` fixes (its layers, widths,
  target layers, block size, mask token, convolutions, selector, window, causality, output
  multiplier and soft cap), as `configure.replace` takes them; a drafter this package cannot
  express is refused with the reason."""
  folder = cfg.drafter.init_from
  c = read_served_config(folder)
  method = c.get("dflash_config")
  why = lambda text: ConfigError(f"drafter.init_from={folder!r}: {text}")
  if "transformer_layer_config" in c or not isinstance(method, dict):
    raise why("not in the flat DFlash2 layout (config.json with a dflash_config section); "
              "the speculators layout is not read")
  if (c.get("architectures") or [None])[0] != ARCHITECTURE:
    raise why(f"architectures={c.get('architectures')} is not [{ARCHITECTURE!r}] (DFlash v1 "
              f"and speculators drafters keep their own embedding and head)")
  m, n = cfg.model, int(c["num_hidden_layers"])
  vocab = int(c["vocab_size"])
  if int(c.get("draft_vocab_size") or vocab) != vocab:
    raise why(f"a reduced draft vocabulary (draft_vocab_size={c['draft_vocab_size']} of "
              f"{vocab}) cannot be represented: the drafter's head is the target's")
  if c.get("attention_bias") or c.get("mlp_bias"):
    raise why("attention_bias / mlp_bias: the drafter's projections have no biases")
  if c.get("hidden_act", "silu") != "silu" or float(c.get("attention_dropout", 0.0)):
    raise why(f"hidden_act={c.get('hidden_act')!r} / attention_dropout: only silu, no dropout")
  types = set(c.get("layer_types") or ["full_attention"])
  if len(types) > 1:
    raise why("layer_types mixes full and sliding layers; drafter.window makes every "
              "layer sliding or none")
  rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type")) not in (None, "default"):
    raise why(f"RoPE {rope} is not the default one")
  if c.get("sample_from_anchor") or method.get("sample_from_anchor"):
    raise why("sample_from_anchor=true scores slot 0; this drafter never does")
  theta = float(rope.get("rope_theta", c.get("rope_theta", 1e4)))
  mismatched = [f"{k}={theirs} (model.{ours}={mine})" for k, theirs, ours, mine in (
      ("hidden_size", int(c["hidden_size"]), "d_model", m.d_model),
      ("target_hidden_size", int(c.get("target_hidden_size") or c["hidden_size"]), "d_model",
       m.d_model),
      ("vocab_size", vocab, "vocab_size", m.vocab_size),
      ("rms_norm_eps", float(c.get("rms_norm_eps", 1e-6)), "norm_eps", m.norm_eps),
      ("rope_theta", theta, "rope_theta", m.rope_theta)) if theirs != mine]
  if mismatched:
    raise why(f"does not fit the target (the drafter shares its width, vocabulary, norm eps "
              f"and RoPE): {'; '.join(mismatched)}")
  sliding = types == {"sliding_attention"}
  layers = _canonical_minus_one(c) or [int(i) for i in method["target_layer_ids"]]
  non_causal = served_non_causal(c, method)
  heads = int(c["num_attention_heads"])
  return dict(
      drafter=dict(n_layers=n, n_heads=heads, n_kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                   d_ff=int(c["intermediate_size"]), target_layers=",".join(map(str, layers)),
                   conv_taps=int(method["conv_kernel_size"]),
                   conv_group_size=int(method["conv_group_size"]),
                   window=int(c["sliding_window"]) if sliding else 0,
                   sliding_causal=sliding and not non_causal),
      objective=dict(block_size=int(c.get("block_size") or method["block_size"]),
                     mask_token_id=int(c.get("mask_token_id", method.get("mask_token_id"))),
                     selector_rank=int(method["selector_rank"]),
                     selector_top_k=int(method["selector_top_k"])),
      model=dict(output_multiplier=float(method.get("output_multiplier", 1.0)),
                 logit_softcap=float(method.get("final_logit_softcapping",
                                                c.get("final_logit_softcapping")) or 0.0)))


def served_non_causal(c: dict, method: dict) -> bool:
  """Whether draft blocks see their whole block on sliding layers: every spelling the seed
  reads (root `is_causal`, `sliding_window_non_causal`, `dflash_config.causal`), which must
  agree; none: causal, the seed's default (dflash/model.py ~1233-1254)."""
  said = {name: value for name, value in (
      ("is_causal", None if c.get("is_causal") is None else not c["is_causal"]),
      ("sliding_window_non_causal", c.get("sliding_window_non_causal")),
      ("dflash_config.causal", None if method.get("causal") is None else not method["causal"]))
      if value is not None}
  if len({bool(v) for v in said.values()}) > 1:
    raise ConfigError(f"the served drafter's causality fields disagree: {said}")
  return bool(next(iter(said.values()), False))


def load_drafter(cfg: Config, drafter_params):
  """params['drafter'] from `drafter.init_from`'s weights, each placed as the leaf of
  `drafter_params` (freshly initialised, sharded) it replaces; the folder must hold exactly
  the drafter's tensors."""
  folder = cfg.drafter.init_from
  path = os.path.join(folder, WEIGHTS_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"drafter.init_from={folder!r} has no {WEIGHTS_FILE}")
  served = safetensors.numpy.load_file(path)
  wanted = drafter_tensors(cfg.drafter.n_layers)
  missing = sorted({t.name for t in wanted} - served.keys())
  extra = sorted(served.keys() - {t.name for t in wanted})
  if missing or extra:
    raise ConfigError(f"drafter.init_from={folder!r}: {WEIGHTS_FILE} is not this drafter's "
                      f"(missing {missing[:3]}, unexpected {extra[:3]})")
  parts = {}
  for t in wanted:
    x = served[t.name]
    parts.setdefault(t.path, []).append(np.swapaxes(x, -1, -2) if t.transposed else x)
  out = jax.tree.map(lambda x: x, drafter_params)
  for leaf_path, xs in parts.items():
    leaf = get_path(drafter_params, leaf_path)
    host = xs[0] if len(xs) == 1 and leaf.ndim == xs[0].ndim else np.stack(xs)
    if host.shape != leaf.shape:
      raise ConfigError(f"drafter.init_from={folder!r}: {'/'.join(leaf_path)} has shape "
                        f"{host.shape}, the drafter's is {leaf.shape}")
    set_path(out, leaf_path, jax.device_put(host.astype(leaf.dtype), leaf.sharding))
  return out
