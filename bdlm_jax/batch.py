"""`Batch`: the rows of one training step, already in the strategy's layout order.

The layout permutation happens here, on the host: permuting inside the jitted step would
make XLA all-gather whole activations (DESIGN.md section 3).
"""

from typing import NamedTuple

import jax
import numpy as np

from bdlm_jax.config import Config, ConfigError
from bdlm_jax.kernels.mask import RowMeta, row_meta
from bdlm_jax.objectives import get_objective
from bdlm_jax.objectives.streams import PAD_VALUES
from bdlm_jax.parallel.layout import apply_layout
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.strategies import plan_for


class Batch(NamedTuple):
  """Each field [S, R], R = seq ranks * rows per rank, in layout order."""

  tokens: np.ndarray  # int32 clean token x_0 of the row's position
  labels: np.ndarray  # int32 target of the row's logit, -1 if none
  maskable: np.ndarray  # bool: the corruption may replace this row's token with [MASK]
  pos: np.ndarray  # int32 RoPE position
  block: np.ndarray  # int32
  seg: np.ndarray  # int32 document id, 0 = padding
  stream: np.ndarray  # int32 NOISY / CLEAN

  @property
  def meta(self) -> RowMeta:
    return row_meta(self.stream, self.block, self.seg, self.pos)


def _check_tokens(cfg: Config, tokens: np.ndarray) -> None:
  if tokens.ndim != 2 or tokens.shape[1] != cfg.data.seq_len or tokens.shape[0] == 0:
    raise ConfigError(f"tokens must be int [S >= 1, data.seq_len={cfg.data.seq_len}], got "
                      f"shape {tokens.shape}")
  check_token_ids(cfg, tokens, "the data")


def check_token_ids(cfg: Config, tokens: np.ndarray, where: str) -> None:
  """Integer ids inside the embedding table and never the [MASK] id (out-of-range ids would
  silently read garbage rows: NaN logits); `where` names the tokens in the error."""
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ConfigError(f"tokens of {where} must be integers, got dtype {tokens.dtype}")
  lo, hi = int(tokens.min()), int(tokens.max())
  if lo < 0 or hi >= cfg.model.vocab_size:
    raise ConfigError(f"token ids must lie in [0, model.vocab_size={cfg.model.vocab_size}); "
                      f"got min {lo}, max {hi} in {where}")
  mask_id = cfg.objective.reserved_mask_id
  if mask_id is not None and np.any(tokens == mask_id):
    raise ConfigError(f"token id {cfg.objective.mask_token_id} is objective.mask_token_id, "
                      f"reserved for [MASK], and appears in {where}")


def make_batch(cfg: Config, tokens, segment_ids=None, protected=None) -> Batch:
  """Logical `tokens` int [S, L] (+ document ids, + True where a token must stay clean)
  -> a `Batch` in the layout of `cfg.parallel.strategy`."""
  tokens = np.asarray(tokens)
  _check_tokens(cfg, tokens)
  seg = np.ones_like(tokens, np.int32) if segment_ids is None else np.asarray(segment_ids)
  prot = np.zeros(tokens.shape, bool) if protected is None else np.asarray(protected, bool)
  for name, arr in (("segment_ids", seg), ("protected", prot)):
    if arr.shape != tokens.shape:
      raise ConfigError(f"{name} shape {arr.shape} must equal tokens shape {tokens.shape}")
  rows = get_objective(cfg.objective.name).logical_rows(tokens, seg, prot, cfg.objective)
  plan = plan_for(cfg)
  rows = apply_layout(plan, rows, PAD_VALUES)
  rows["labels"] = np.where(plan.first_copies[None], rows["labels"], -1)
  return Batch(**{f: rows[f] for f in Batch._fields})


def abstract_batch(cfg: Config, mesh) -> Batch:
  """Shapes, dtypes and shardings of the `Batch` that `make_batch` gives for `cfg`'s global
  batch (`train.batch_size` sequences), without data: for compile-only probes."""
  rows = plan_for(cfg).rows.size
  spec = lambda dtype: jax.ShapeDtypeStruct((cfg.train.batch_size, rows), dtype,
                                            sharding=row_sharding(mesh))
  return Batch(*(spec(np.bool_ if f == "maskable" else np.int32) for f in Batch._fields))
