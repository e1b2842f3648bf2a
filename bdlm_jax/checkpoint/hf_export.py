"""bdlm_jax params -> a Hugging Face folder that `transformers` loads as Llama, Qwen3,
Qwen3-MoE, Gemma 3 (`Gemma3ForCausalLM`), Gemma 4, DiffusionGemma, Qwen3.5 or Qwen3-Next,
whichever expresses the model (`hf_names.hf_model_type`; where two do, the family of the
folder the model came from).

config.json also records `bdlm_mask_token_id`, `bdlm_block_size` and `bdlm_objective`, so
a PyTorch user can run the BDLM (put [MASK] in a block, read its logits) and `import_hf`
gets them back; generation_config.json holds the special token ids of `data.tokenizer`.
Writes safetensors only; torch and transformers are not needed.
"""

from __future__ import annotations

import os
import re
import warnings

import jax
import numpy as np

from bdlm_jax.checkpoint.hf_gemma4 import text_config
from bdlm_jax.checkpoint.hf_import import INDEX_FILE, read_generation_config, read_hf_config
from bdlm_jax.checkpoint.hf_names import get_path, hf_config, hf_model_type, tensor_map
from bdlm_jax.checkpoint.manager import restore_state
from bdlm_jax.checkpoint.out_dir import check_out_dir, make_out_dir, save_tensors, write_json
from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel.mesh import make_mesh, to_host

MAX_SHARD_BYTES = 5 * 2**30
_OUR_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def export_hf(params, cfg: Config, out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES,
              vision_from: str | None = None) -> None:
  """Writes config.json, generation_config.json and model.safetensors (or shards + index) in
  `cfg.export.dtype`, into a new or empty `out_dir` (`check_out_dir`).

  The HF folder the model came from, `vision_from` or else `cfg.init_from`, gives what our
  params do not hold: its generation_config.json (EOS list, sampler defaults) is carried
  over, and a DiffusionGemma (`model.self_conditioning`) takes its vision tower (vision_config
  and tensors, as they are) and its `use_bidirectional_attention`. A DiffusionGemma without
  such a folder is refused unless `export.toy_vision` asks for the smallest Gemma 4 vision
  tower, which transformers initialises at random.
  Where two families express the model (Qwen3.5 and Qwen3-Next), that folder's is written.
  Sharded params are gathered to the host one tensor at a time; only process 0 writes.
  """
  source = vision_from or cfg.init_from or None
  like = _source_type(source)
  hf_model_type(cfg.model, like)  # a model no family expresses is refused first
  if cfg.model.output_multiplier != 1:
    raise ConfigError(f"model.output_multiplier={cfg.model.output_multiplier} (a verifier's "
                      f"logit multiplier, read on import) has no key in the Hugging Face "
                      f"families export_hf writes, so their logits would differ: not exported")
  if cfg.model.self_conditioning and not source and not cfg.export.toy_vision:
    raise ConfigError(
        "a DiffusionGemma export needs the vision tower of the Hugging Face folder it was "
        "imported from: set init_from to that folder (or pass vision_from=...), or set "
        "export.toy_vision=true to write a random one-layer tower (text use only)")
  check_out_dir(out_dir, cfg.export.overwrite)
  dtype = jax.numpy.dtype(cfg.export.dtype)
  host, parts = {}, {}
  for t in tensor_map(cfg.model, like):
    if t.path not in host:  # a stacked weight is gathered once for all its layers
      x = to_host(get_path(params, t.path))
      # An offset comes off in float32, before the cast (Gemma's norm weights: scale - 1).
      host[t.path] = (x.astype(np.float32) - t.offset if t.offset else x).astype(dtype)
    x = host[t.path][t.index]  # its layer's (and expert's) slice of a stacked weight
    x = np.swapaxes(x, -1, -2) if t.transposed else x
    for name in (t.name, *t.copies):
      parts.setdefault(name, []).append((t.out_rows(x.shape), x))
  tensors = {name: _assemble(p) for name, p in parts.items()}
  vision = None
  if source and cfg.model.self_conditioning:
    vision, tensors = _with_vision_tower(source, tensors)
  if jax.process_index() != 0:
    return
  make_out_dir(out_dir)
  for stale in (f for f in os.listdir(out_dir) if _OUR_FILES.match(f)):
    os.remove(os.path.join(out_dir, stale))  # shards of an earlier export, as save_pretrained
  shards = _split(tensors, max_shard_bytes)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  mode = _new_file_mode()
  for file, shard in zip(names, shards):
    path = os.path.join(out_dir, file)
    save_tensors(shard, path, metadata={"format": "pt"})
    os.chmod(path, mode)  # safetensors renames a private (0600) temporary file into place
  if len(shards) > 1:
    write_json(os.path.join(out_dir, INDEX_FILE), {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": {n: file for file, shard in zip(names, shards) for n in shard}})
  extra = {"bdlm_mask_token_id": cfg.objective.mask_token_id,
           "bdlm_block_size": cfg.objective.block_size, "bdlm_objective": cfg.objective.name}
  config = hf_config(cfg.model, cfg.export.dtype, _max_positions(cfg, source), extra, vision,
                     like)
  if vision:  # the source's text attention rule (import accepted it: text stays causal)
    config["text_config"]["use_bidirectional_attention"] = text_config(
        read_hf_config(source)).get("use_bidirectional_attention")
  write_json(os.path.join(out_dir, "config.json"), config)
  write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(cfg, source))


def export_checkpoint(cfg: Config, workdir: str) -> tuple[int, str]:
  """mode=export: the params of checkpoint `export.checkpoint_step` (-1: latest) of
  `workdir` -> `export.out_dir`; returns (step, out_dir)."""
  if not cfg.export.out_dir:
    raise ConfigError("mode=export needs export.out_dir, e.g. --set export.out_dir=runs/hf")
  drafter = get_objective(cfg.objective.name).DRAFTER
  if drafter:  # the served DFlash2 folder (checkpoint/hf_drafter.py)
    from bdlm_jax.checkpoint.hf_drafter import check_servable, export_drafter
    check_servable(cfg)
  check_out_dir(cfg.export.out_dir, cfg.export.overwrite)  # before the restore, which may be long
  step, state = restore_state(cfg, workdir, make_mesh(cfg), cfg.export.checkpoint_step)
  if drafter:
    export_drafter(state.params, cfg, cfg.export.out_dir, step, workdir)
  else:
    export_hf(state.params, cfg, cfg.export.out_dir)
  return step, cfg.export.out_dir


def _with_vision_tower(folder: str, tensors: dict) -> tuple[dict, dict]:
  """(vision_config, tensors plus the vision tower's) of a DiffusionGemma folder."""
  from bdlm_jax.checkpoint.hf_gemma4 import VISION_PREFIXES
  from bdlm_jax.checkpoint.hf_import import _TensorFiles
  vision = read_hf_config(folder).get("vision_config")
  if not vision:
    raise ConfigError(f"vision_from={folder!r} has no vision_config in its config.json")
  with _TensorFiles(folder) as files:
    tower = {n: files.get_slice(n)[:] for n in sorted(files.names) if n.startswith(VISION_PREFIXES)}
  return vision, {**tensors, **tower}


def _assemble(parts: list) -> np.ndarray:
  """An HF tensor from its (rows, x) parts: x is the whole tensor (rows None) or those rows
  of its out axis (-2; Gemma 4's halves of gate_up_proj, Qwen3-Next's fused projections)."""
  rows, x = parts[0]
  if rows is None:
    return np.ascontiguousarray(x)
  filled = np.concatenate([rows for rows, _ in parts])
  assert np.array_equal(np.sort(filled), np.arange(filled.size)), "rows left unwritten"
  out = np.empty(x.shape[:-2] + (filled.size, x.shape[-1]), x.dtype)
  for rows, x in parts:
    out[..., rows, :] = x
  return out


def _source_type(source: str | None) -> str | None:
  """The model_type of the folder the model came from (None without one, or where this
  machine cannot read it)."""
  try:
    return read_hf_config(source).get("model_type") if source else None
  except ConfigError:
    return None


def _split(tensors: dict, max_bytes: int) -> list[dict]:
  """Consecutive groups of at most `max_bytes` (a larger tensor gets a file of its own)."""
  shards, size = [{}], 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  return shards


def _generation_config(cfg: Config, source: str | None) -> dict:
  """The source folder's generation_config.json as it is (its EOS list and sampler
  defaults); without one, the BOS / EOS / PAD ids of `data.tokenizer` (none where this
  machine cannot read it)."""
  from bdlm_jax.data.tokenizers import make_tokenizer  # late: the data package needs grain
  carried = read_generation_config(source) if source else {}
  if carried:
    return carried
  try:
    tokenizer = make_tokenizer(cfg.data)
  except ConfigError:
    return {}
  ids = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
             pad_token_id=tokenizer.pad_id)
  return {k: v for k, v in ids.items() if v is not None}


def _max_positions(cfg: Config, source: str | None) -> int:
  """max_position_embeddings: the source model's, unless the run trained longer sequences
  (data.seq_len): fine-tuning at a short L does not shrink what the model supports."""
  if not source:
    return cfg.data.seq_len
  try:
    imported = text_config(read_hf_config(source)).get("max_position_embeddings") or 0
  except ConfigError as e:  # the folder is not on this machine
    warnings.warn(f"max_position_embeddings is data.seq_len={cfg.data.seq_len}, as the "
                  f"folder the model came from cannot be read: {e}")
    return cfg.data.seq_len
  return max(imported, cfg.data.seq_len)


def _new_file_mode() -> int:
  """The mode `open` gives a new file: 0666 less the process's umask."""
  umask = os.umask(0)  # reading it means setting it; put back at once
  os.umask(umask)
  return 0o666 & ~umask
