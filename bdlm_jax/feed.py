"""This process's data on the mesh: packed batches from the pipeline, laid out for the
strategy on the host and placed on the devices that hold them. Training and held-out
evaluation read through the same feed, so they see data the same way. A drafter with
precomputed target features (`drafter.features`) reads those records instead of text."""

import jax
import numpy as np
from jax.experimental import multihost_utils

from bdlm_jax.batch import Batch, make_batch, reads_features
from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import make_dataset
from bdlm_jax.data.chat import Truncations
from bdlm_jax.data.features import feature_dataset
from bdlm_jax.objectives import reserved_mask_id
from bdlm_jax.parallel.mesh import data_shard, put_batch
from bdlm_jax.parallel.prune import widen
from bdlm_jax.parallel.registry import plan_for


class Feed:
  """An endless, checkpointable iterator of global `Batch`es of `train.batch_size` sequences
  from `split` ("train" or the held-out "eval"); `get_state` / `set_state` are the pipeline's
  (the text pipeline's, or the feature records' for `drafter.features`). `truncations`
  counts the conversations this process's batches cut to `data.seq_len`."""

  def __init__(self, cfg: Config, mesh, split: str = "train"):
    self._cfg, self._mesh = cfg, mesh
    self.truncations = Truncations()
    shard, n_shards, self._local = data_shard(mesh, cfg.train.batch_size)
    local_batch = self._local.stop - self._local.start
    if reads_features(cfg):
      self._data = _feature_batches(cfg, split, local_batch, shard, n_shards)
    else:
      self._data = make_dataset(
          cfg.data, batch_size=local_batch, seed=cfg.seed, vocab_size=cfg.model.vocab_size,
          process_index=shard, process_count=n_shards, block_size=cfg.objective.block_size,
          mask_token_id=reserved_mask_id(cfg), split=split)

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    return self.next()

  def next(self, key=None) -> Batch:
    """The next batch; `key` (the step's) draws a drafter's anchors (`make_batch`), folded
    with this process's first sequence so that processes draw apart."""
    raw = next(self._data)
    self.truncations.add(raw)
    if key is not None:
      key = jax.random.fold_in(key, self._local.start)
    batch = make_batch(self._cfg, raw["tokens"], raw["segment_ids"], raw.get("protected"),
                       raw.get("features"), key=key)
    if batch.kept is not None and jax.process_count() > 1:  # one width for every process
      plan = plan_for(self._cfg)
      width = multihost_utils.process_allgather(np.int32(batch.kept.shape[1])).max()
      batch = batch._replace(kept=widen(batch.kept, plan, int(width) // plan.num_ranks))
    return put_batch(batch, self._mesh, self._cfg.train.batch_size, self._local)

  def get_state(self) -> dict:
    return self._data.get_state()

  def set_state(self, state: dict) -> None:
    self._data.set_state(state)


def _feature_batches(cfg: Config, split: str, batch_size: int, shard: int, n_shards: int):
  """The precomputed records, sharded over processes as the text pipeline's documents."""
  if split != "train":
    raise ConfigError(f"drafter.features={cfg.drafter.features!r} holds training sequences "
                      f"only; held-out ({split!r}) data needs the co-hosted target")
  return feature_dataset(cfg, batch_size=batch_size, process_index=shard,
                         process_count=n_shards)
