"""Hugging Face folder (config.json + *.safetensors) -> bdlm_jax Config and params.

Each array is built on the mesh from the safetensors slices its devices hold
(`jax.make_array_from_callback`), so an fsdp-sharded import never materialises a whole
checkpoint on one host. Reads safetensors only; torch and transformers are not needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import warnings

import jax
import numpy as np
import safetensors
from jax.sharding import SingleDeviceSharding

from bdlm_jax.checkpoint.hf_gemma4 import CANVAS_LENGTH, DIFFUSION_GEMMA, VISION_PREFIXES
from bdlm_jax.checkpoint.hf_names import (IGNORED_SUFFIXES, Tensor, get_path,
                                          model_config_from_hf, set_path, shape_fields,
                                          tensor_map)
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.models import rope
from bdlm_jax.objectives import diffusiongemma
from bdlm_jax.params import transformer_params
from bdlm_jax.parallel.zero3 import zero3_shardings

INDEX_FILE = "model.safetensors.index.json"
VOCAB_TENSORS = ("model.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                 "lm_head.weight")  # [vocab, d_model] in HF
# ModelConfig fields a config.json sets that leave the params' shapes alone.
_BEHAVIOUR_KEYS = ("rope_theta", "rope_local_theta", "rope_scaling", "rope_local_scaling",
                   "norm_eps", "layer_pattern", "sliding_window", "scale_embeddings",
                   "query_pre_attn_scalar", "mlp_activation", "logit_softcap", "moe_top_k",
                   "moe_norm_topk", "global_partial_rotary_factor", "last_layer_global", "v_norm",
                   "partial_rotary_factor", "output_multiplier")


def import_hf(path: str, dtype: str = "float32", mesh=None) -> tuple[Config, dict]:
  """(cfg, params) from a Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Qwen3.5 (text, dense or
  MoE), Qwen3-Next, Gemma 3 (text), Gemma 4 (text) or DiffusionGemma (its text model: the
  vision tower is left out, with a warning) Hugging Face folder, params placed on `mesh`.

  `cfg.model` comes from config.json (params and compute in `dtype`); every other section
  keeps the `Config()` defaults, except:
  * `objective.block_size` is `bdlm_block_size` when `export_hf` recorded it, else a
    DiffusionGemma's `canvas_length` (data.seq_len then a multiple of it), and
    `data.tokenizer` is the folder when it holds tokenizer.json;
  * a DiffusionGemma trains with its own objective, `objective.name=diffusiongemma`;
  * a length-dependent RoPE scaling (dynamic, longrope) is fixed at `data.seq_len`
    (models/rope.py);
  * `objective.mask_token_id` is `bdlm_mask_token_id` when recorded, else an id no text
    encodes to, from the folder's tokenizer (`pick_mask_id`: its mask token, an embedding row
    beyond its vocabulary as Fast-dLLM v2 uses 151665 of Qwen2.5, a reserved placeholder).
    Failing that, or without a tokenizer.json to tell free ids from real tokens, [MASK] gets
    a new row: `model.vocab_size` grows by one and the new embedding (and head) row is the
    mean of the others, a neutral start that training then moves. A DiffusionGemma folder
    never gets one (its canvases are corrupted with uniform tokens, not [MASK]): its
    vocabulary stays the folder's, and [MASK] falls back to the last id.
  """
  hf = read_hf_config(path)
  model = dict(model_config_from_hf(hf, path), param_dtype=dtype, compute_dtype=dtype)
  defaults = Config()
  diffusion = hf.get("model_type") == DIFFUSION_GEMMA
  block = int(hf.get("bdlm_block_size", hf.get("canvas_length", CANVAS_LENGTH) if diffusion
                     else defaults.objective.block_size))
  data = dict(seq_len=math.lcm(defaults.data.seq_len, block))
  for key in ("rope_scaling", "rope_local_scaling"):  # dynamic, longrope: at the trained length
    if key in model:
      model[key] = rope.at_length(model[key], data["seq_len"])
  mask = hf.get("bdlm_mask_token_id")
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    from bdlm_jax.data.tokenizers import HFTokenizer, pick_mask_id  # late: data needs grain
    from bdlm_jax.data.chat import FOLDER, has_template
    data["tokenizer"] = path
    if has_template(path):  # the format the model was trained with (data.format=chat)
      data["chat_template"] = FOLDER
    if mask is None:
      mask = pick_mask_id(HFTokenizer(path), model["vocab_size"])
  if mask is None and diffusion:
    mask = model["vocab_size"] - 1
  if mask is None:
    mask, model["vocab_size"] = model["vocab_size"], model["vocab_size"] + 1
  objective = dict(mask_token_id=int(mask), block_size=block)
  if diffusion:
    objective.update(name=diffusiongemma.NAME, loss_weight="unit")
  cfg = replace(defaults, model=model, data=data, objective=objective,
                sample=sample_options(read_generation_config(path), diffusion))
  return cfg, _read_params(path, cfg, mesh)


# DiffusionGemmaGenerationConfig's sampler keys -> sample.* (the entropy bound is nested).
_CANVAS_SAMPLER = dict(max_new_tokens="max_new_tokens", max_denoising_steps="denoising_steps",
                       t_min="t_min", t_max="t_max", stability_threshold="stability_threshold",
                       confidence_threshold="confidence_threshold")


def sample_options(generation: dict, diffusion: bool) -> dict:
  """sample.* of a folder's generation config: its EOS list, and a DiffusionGemma's canvas
  sampler settings (max_new_tokens 256 where it has none, transformers' default)."""
  options = {"eos_ids": eos_ids(generation)} if generation.get("eos_token_id") is not None else {}
  if diffusion:
    options["max_new_tokens"] = 256
    options.update({ours: generation[hf] for hf, ours in _CANVAS_SAMPLER.items()
                    if generation.get(hf) is not None})
    bound = (generation.get("sampler_config") or {}).get("entropy_bound")
    if bound is not None:
      options["entropy_bound"] = bound
  return options


def params_from_hf(cfg: Config, mesh=None, layers: bool = True) -> dict:
  """Params of the HF folder `cfg.init_from`, which must have the shapes of `cfg.model`;
  without `layers`, only the weights outside the layer stacks (embedding, final norm, head)
  are read, for a drafter whose target's features are precomputed.

  Only shapes are enforced, and the vocabulary may be larger than the folder's (a [MASK] row
  `import_hf` added starts as the mean row); other architecture fields that differ from the
  folder's (a context extension's RoPE base or scaling) are used as configured, each change
  printed as "was / now".
  """
  path = cfg.init_from
  hf_config = ModelConfig(**model_config_from_hf(read_hf_config(path), path))
  hf_shapes, our_shapes = shape_fields(hf_config), shape_fields(cfg.model)
  fits = lambda k: (hf_shapes[k] <= our_shapes[k] if k == "vocab_size"
                    else hf_shapes[k] == our_shapes.get(k))  # d_ff is absent with experts
  wrong = [f"{k} (folder {hf_shapes[k]!r}, config {our_shapes.get(k, 'unused')!r})"
           for k in hf_shapes if not fits(k)]
  if wrong:
    raise ConfigError(f"init_from={path} does not fit model.*: {'; '.join(wrong)}. Set those "
                      f"model.* keys to the folder's values (import_hf(path) returns them)")
  if jax.process_index() == 0:
    for line in conversion_changes(hf_config, cfg.model):
      print(f"init_from={path}: {line}")
  return _read_params(path, cfg, mesh, layers)


def conversion_changes(folder: ModelConfig, model: ModelConfig) -> list[str]:
  """'model.K was X, now Y' for each field a conversion may change without touching the
  weights (a context extension's RoPE base or scaling, a window...)."""
  return [f"model.{k} was {getattr(folder, k)!r}, now {getattr(model, k)!r}"
          for k in _BEHAVIOUR_KEYS if getattr(folder, k) != getattr(model, k)]


def read_hf_config(path: str) -> dict:
  if not os.path.isdir(path):
    raise ConfigError(f"Hugging Face folder {path!r} does not exist (it needs config.json and "
                      f"*.safetensors)")
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise ConfigError(f"{path} has no config.json; save the model with "
                      f"model.save_pretrained({path!r})")
  with open(config_file) as f:
    return json.load(f)


def read_generation_config(path: str) -> dict:
  """The folder's generation_config.json ({} without one)."""
  file = os.path.join(path, "generation_config.json")
  if not os.path.isfile(file):
    return {}
  with open(file) as f:
    return json.load(f)


def eos_ids(generation: dict) -> str:
  """A generation config's `eos_token_id` (an id or a list) as `sample.eos_ids` spells it."""
  ids = generation.get("eos_token_id")
  ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
  return ",".join(str(int(i)) for i in ids)


def _check_copies(files, tensors: list[Tensor]) -> None:
  """Warns where an HF tensor's copies (DiffusionGemma's decoder `layer_scalar`s) differ from
  the tensor that is read: one value per layer is kept, and transformers' canvas pass reads
  the copies."""
  differ = []
  for t in tensors:
    read = np.asarray(files.get_slice(t.name)[:], np.float32)
    for copy in t.copies:
      gap = float(np.abs(np.asarray(files.get_slice(copy)[:], np.float32) - read).max())
      if gap > 0:
        differ.append(f"{copy} (|difference| {gap:.3g})")
  if differ:
    warnings.warn(f"{files.path}: {', '.join(differ)} differ from the tensors read in their "
                  f"place ({tensors[0].name}, ...): bdlm_jax keeps one value per layer, so its "
                  f"canvas logits will differ from transformers'")


def _read_params(path: str, cfg: Config, mesh, layers: bool = True) -> dict:
  """The params of `cfg.model` from the folder, or without `layers` those of the same model
  with no layers (the rest of the folder's tensors are then expected, unread)."""
  model = cfg.model if layers else dataclasses.replace(cfg.model, n_layers=0)
  abstract = transformer_params(model)
  if mesh is None:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
  else:
    shardings = zero3_shardings(mesh, abstract, cfg.parallel.expert_axis_names)
  like = read_hf_config(path).get("model_type")  # the folder's family, of those that fit
  names = tensor_map(model, like)
  by_path: dict[tuple, list] = {}
  for t in names:
    by_path.setdefault(t.path, []).append(t)  # a stacked weight: one HF tensor per slice
  params = {}
  with _TensorFiles(path) as files:
    for where, tensors in by_path.items():
      want = get_path(abstract, where)
      lead = len(tensors[0].index)  # stacked axes: 0, 1 (layers) or 2 (layers, experts)
      shape = want.shape[lead:]
      hf_shape = tensors[0].hf_shape(shape)
      grid = np.empty(want.shape[:lead], object)  # the HF tensor of each stacked slice
      for t in tensors:
        grid[t.index] = files.get_slice(t.name)
      if tensors[0].name in VOCAB_TENSORS and grid[()].get_shape()[0] < hf_shape[0]:
        grid[()] = _MeanRowsAdded(grid[()], hf_shape[0])
      for t in tensors:
        if tuple(grid[t.index].get_shape()) != hf_shape:
          raise ConfigError(f"{path}: tensor {t.name!r} has shape "
                            f"{tuple(grid[t.index].get_shape())}, but config.json implies "
                            f"{hf_shape}")
      set_path(params, where, _place(grid, tensors[0], want, get_path(shardings, where)))
    _check_copies(files, [t for t in names if t.copies])
    used = {name for t in tensor_map(cfg.model, like) for name in (t.name, *t.copies)}
    vision = sorted(n for n in files.names if n.startswith(VISION_PREFIXES))
    if vision:
      warnings.warn(f"{path}: the vision tower ({len(vision)} tensors under "
                    f"{', '.join(VISION_PREFIXES)}) is left out: bdlm_jax imports the text model")
    unused = sorted(n for n in files.names - used - set(vision)
                    if not n.endswith(IGNORED_SUFFIXES)
                    and not (n == "lm_head.weight" and cfg.model.tie_embeddings))
    if unused:
      warnings.warn(f"{path}: ignoring tensors this architecture does not use: {unused}")
  return params


def _place(grid: np.ndarray, hf: Tensor, want, sharding) -> jax.Array:
  """One global array; each device reads only its own slice from the files (for a stacked
  weight: its slice of every layer, or layer and expert, it holds; `grid` has the HF tensor
  of each). `hf` says how HF stores it: transposed, or offset (added in float32 before the
  cast, as HF computes it)."""
  def read_one(tensor, index):
    x = hf.take_rows(tensor[hf.hf_index(index, want.shape[grid.ndim:])], index)
    x = np.swapaxes(x, -1, -2) if hf.transposed else x
    return x.astype(np.float32) + hf.offset if hf.offset else x

  def read(index):
    lead = grid.ndim
    held = grid[(*index[:lead], ...)]  # the HF tensors of this device's stacked slices
    x = np.stack([read_one(t, index[lead:]) for t in held.reshape(-1)])
    return np.ascontiguousarray(x.reshape(held.shape + x.shape[1:]).astype(want.dtype))

  return jax.make_array_from_callback(want.shape, sharding, read)


class _MeanRowsAdded:
  """A [vocab, d_model] HF tensor seen with `rows` rows: the added ones are its mean row.

  The mean is accumulated over row chunks, so no host holds the whole tensor at once.
  """

  def __init__(self, tensor, rows: int, chunk: int = 8192):
    self._tensor, self._rows = tensor, rows
    self._have, width = tensor.get_shape()
    total = np.zeros(width, np.float64)
    for i in range(0, self._have, chunk):
      part = tensor[i:min(i + chunk, self._have)]
      total += part.astype(np.float64).sum(0)
    self._mean = (total / self._have).astype(part.dtype)

  def get_shape(self) -> list[int]:
    return [self._rows, self._mean.size]

  def __getitem__(self, index):
    rows, cols = index
    start, stop, _ = rows.indices(self._rows)
    parts = [self._tensor[start:min(stop, self._have), cols]] if start < self._have else []
    added = max(stop, self._have) - max(start, self._have)
    return np.concatenate(parts + [np.repeat(self._mean[cols][None], added, axis=0)])


# A multimodal Qwen3.5 folder keeps its text model under `model.language_model.` (read as
# `model.`); its vision tower and multi-token-prediction head are not read.
TEXT_PREFIX = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class _TensorFiles:
  """Tensor name -> lazily sliced tensor, over one or several safetensors files (text
  weights under `model.language_model.` answer to their `model.` names)."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
      with open(index) as f:
        self._file_of = json.load(f)["weight_map"]
    else:
      self._file_of = {}
      for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safetensors.safe_open(os.path.join(path, file), framework="numpy") as f:
          self._file_of.update({name: file for name in f.keys()})
    self._stored = {name: name for name in self._file_of}
    if any(name.startswith(TEXT_PREFIX[0]) for name in self._file_of):
      self._stored = {name.replace(*TEXT_PREFIX, 1): name for name in self._file_of
                      if not name.startswith(SKIPPED_PREFIXES)}
      self._file_of = {name: self._file_of[stored] for name, stored in self._stored.items()}
    if not self._file_of:
      raise ConfigError(f"{path} holds no *.safetensors weights (PyTorch .bin files are not "
                        f"read: re-save with model.save_pretrained(..., safe_serialization=True))")
    self.names = set(self._file_of)
    self._stack = contextlib.ExitStack()
    self._open = {}

  def get_slice(self, name: str):
    if name not in self._file_of:
      raise ConfigError(f"{self.path}: tensor {name!r} is missing from the safetensors files "
                        f"(config.json says the model has it)")
    file = self._file_of[name]
    if file not in self._open:
      self._open[file] = self._stack.enter_context(
          safetensors.safe_open(os.path.join(self.path, file), framework="numpy"))
    return self._open[file].get_slice(self._stored[name])

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._stack.close()
