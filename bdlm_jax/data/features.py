"""Precomputed target features (`drafter.features`), for a drafter whose target is too large
to co-host: packed sequences and the target's hidden states at its chosen layers, written by
experiments/dflash_features.py and read here, memory-mapped, as one Grain pipeline.

A folder holds `tokens.npy` int32 [N, L], `segment_ids.npy` int32 [N, L], `protected.npy`
bool [N, L], `features.npy` [N, L, K, D] and `meta.json` {seq_len, target_layers, d_model,
dtype, target}.
"""

import json
import os

import grain
import numpy as np

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.drafter import target_layer_ids

ARRAYS = ("tokens", "segment_ids", "protected", "features")
META = "meta.json"


def check_meta(cfg: Config, folder: str) -> dict:
  """The folder's meta.json, checked against `cfg`: every mismatch named in one ConfigError,
  before anything compiles."""
  where = f"drafter.features={folder!r}"
  missing = [f for f in (META, *(f"{a}.npy" for a in ARRAYS))
             if not os.path.isfile(os.path.join(folder, f))]
  if not os.path.isdir(folder) or missing:
    what = "does not exist" if not os.path.isdir(folder) else f"lacks {', '.join(missing)}"
    raise ConfigError(f"{where} {what}: write it with experiments/dflash_features.py")
  with open(os.path.join(folder, META)) as f:
    meta = json.load(f)
  want = dict(seq_len=("data.seq_len", cfg.data.seq_len),
              target_layers=("drafter.target_layers", list(target_layer_ids(cfg))),
              d_model=("model.d_model", cfg.model.d_model))
  wrong = [f"{k} {meta.get(k)!r} (config {key}: {value!r})" for k, (key, value) in want.items()
           if meta.get(k) != value]
  if wrong:
    raise ConfigError(f"{where} does not fit the config: {'; '.join(wrong)}")
  return meta


class FeatureRecords:
  """Random access to the folder's packed sequences: record i is one sequence and its
  features, read from the memory-mapped arrays only when asked for."""

  def __init__(self, folder: str):
    self._arrays = {a: np.load(os.path.join(folder, f"{a}.npy"), mmap_mode="r") for a in ARRAYS}

  def __len__(self) -> int:
    return len(self._arrays["tokens"])

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {a: np.asarray(x[i]) for a, x in self._arrays.items()}


def feature_dataset(cfg: Config, *, batch_size: int, process_index: int = 0,
                    process_count: int = 1) -> grain.DatasetIterator:
  """This process's batches {"tokens", "segment_ids", "protected", "features"} of
  `batch_size` records, forever: records p, p + P, ... (disjoint shards, as the text
  pipeline's documents), reshuffled every epoch from `cfg.seed` when `data.shuffle`;
  checkpointable by `get_state` / `set_state`."""
  folder = cfg.drafter.features
  check_meta(cfg, folder)
  records = grain.MapDataset.source(FeatureRecords(folder))[process_index::process_count]
  if len(records) < batch_size:
    raise ConfigError(f"drafter.features={folder!r} gives process {process_index} of "
                      f"{process_count} {len(records)} sequences, fewer than its batch of "
                      f"{batch_size}")
  if cfg.data.shuffle:
    records = records.shuffle(cfg.seed)
  records = records.repeat().to_iter_dataset(grain.ReadOptions(
      num_threads=cfg.data.num_threads, prefetch_buffer_size=2 * batch_size))
  return iter(records.batch(batch_size, drop_remainder=True))
