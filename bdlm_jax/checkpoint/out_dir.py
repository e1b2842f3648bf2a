"""The folder an export writes into, and its files, whichever model it exports."""

import json
import os

import safetensors
import safetensors.numpy

from bdlm_jax.errors import ConfigError, cause


def check_out_dir(out_dir: str, overwrite: bool) -> None:
  """An export goes into a new or empty folder: files already there (an earlier model's
  generation_config.json, tokenizer, notes) would pass for this model's. `overwrite`
  (export.overwrite) allows a folder that is not empty: the export replaces its own files."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(f"export.out_dir={out_dir!r} is a file, not a folder")
  held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
  if held and not overwrite:
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    raise ConfigError(
        f"export.out_dir={out_dir!r} is not empty (it holds {shown}); choose a new folder, or "
        f"set export.overwrite=true to write over the files an export writes (others stay)")


def write_json(file: str, obj: dict) -> None:
  with open(file, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")


def make_out_dir(out_dir: str) -> None:
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"export.out_dir={out_dir!r} cannot be created: {e}") from e


def save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
  """safetensors' save_file, failing in one line (a full disk, a file size limit)."""
  try:
    safetensors.numpy.save_file(tensors, path, metadata=metadata)
  except safetensors.SafetensorError as e:
    raise OSError(f"writing {path} failed: {cause(e)}") from None
