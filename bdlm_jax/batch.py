"""`Batch`: the rows of one training step, already in the strategy's layout order.

The layout permutation happens here, on the host: permuting inside the jitted step would
make XLA all-gather whole activations (docs/strategies.md).
"""

from typing import NamedTuple

import jax
import numpy as np

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.drafter import target_layer_ids
from bdlm_jax.kernels.mask import CLEAN, RowMeta, row_meta
from bdlm_jax.objectives import get_objective, reserved_mask_id
from bdlm_jax.objectives.streams import PAD_VALUES
from bdlm_jax.parallel.layout import apply_layout
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.prune import context_rows, kept_rows, pruned_rows
from bdlm_jax.parallel.registry import plan_for


class Batch(NamedTuple):
  """Each field [S, R, ...], R = seq ranks * rows per rank, in layout order."""

  tokens: np.ndarray  # int32 clean token x_0 of the row's position
  labels: np.ndarray  # int32 target of the row's logit, -1 if none
  maskable: np.ndarray  # bool: the corruption may replace this row's token with [MASK]
  pos: np.ndarray  # int32 RoPE position
  block: np.ndarray  # int32
  seg: np.ndarray  # int32 document id, 0 = padding
  stream: np.ndarray  # int32 NOISY / CLEAN
  # [S, R, K, D] precomputed target features (drafter.features), in model.compute_dtype:
  # a context row holds its position's, other rows zeros. None: the target runs in the step.
  context: np.ndarray | None = None
  # [S, P * cap] int32: each rank's context rows that a draft window reaches, as indices into
  # its context slot, -1 after them (drafter.kept_context_rows; parallel/prune.py). None:
  # nothing is pruned.
  kept: np.ndarray | None = None

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
  mask_id = reserved_mask_id(cfg)
  if mask_id is not None and np.any(tokens == mask_id):
    raise ConfigError(f"token id {cfg.objective.mask_token_id} is objective.mask_token_id, "
                      f"reserved for [MASK], and appears in {where}")


def make_batch(cfg: Config, tokens, segment_ids=None, protected=None, context=None,
               key=None) -> Batch:
  """Logical `tokens` int [S, L] (+ document ids, + True where a token must stay clean,
  + a drafter's precomputed target features [S, L, K, D]) -> a `Batch` in the layout of
  `cfg.parallel.strategy`. `key`: the step's key, from which a drafter's anchors are drawn
  (objectives/dflash.py; None: from the tokens, the same every time); others ignore it."""
  tokens = np.asarray(tokens)
  _check_tokens(cfg, tokens)
  seg = np.ones_like(tokens, np.int32) if segment_ids is None else np.asarray(segment_ids)
  prot = np.zeros(tokens.shape, bool) if protected is None else np.asarray(protected, bool)
  for name, arr in (("segment_ids", seg), ("protected", prot)):
    if arr.shape != tokens.shape:
      raise ConfigError(f"{name} shape {arr.shape} must equal tokens shape {tokens.shape}")
  drafter = get_objective(cfg.objective.name).DRAFTER
  rows = get_objective(cfg.objective.name).logical_rows(tokens, seg, prot, cfg.objective,
                                                        **(dict(key=key) if drafter else {}))
  plan = plan_for(cfg)
  rows = apply_layout(plan, rows, PAD_VALUES)
  rows["labels"] = np.where(plan.first_copies[None], rows["labels"], -1)
  if get_objective(cfg.objective.name).DRAFTER:
    rows["kept"] = kept_rows(cfg, plan, rows)
  if context is not None or reads_features(cfg):
    rows["context"] = _layout_context(cfg, rows, context)
  return Batch(**{f: rows[f] for f in Batch._fields if f in rows})


def reads_features(cfg: Config) -> bool:
  """Whether the batches carry a drafter's precomputed target features (`drafter.features`)."""
  return bool(cfg.drafter.features) and get_objective(cfg.objective.name).DRAFTER


def _layout_context(cfg: Config, rows: dict, context) -> np.ndarray:
  """Features [S, L, K, D] -> [S, R, K, D] in layout order: each context (clean) row reads
  its position's, wherever the layout put it (replicated too, under bp); draft and padding
  rows get zeros."""
  want = (*rows["tokens"].shape[:1], cfg.data.seq_len, len(target_layer_ids(cfg)),
          cfg.model.d_model)
  if not reads_features(cfg):
    raise ConfigError(f"make_batch got a context (target features), which only a drafter "
                      f"objective with drafter.features set reads (objective="
                      f"{cfg.objective.name!r}, drafter.features={cfg.drafter.features!r})")
  if context is None or np.shape(context) != want:
    got = "none" if context is None else np.shape(context)
    raise ConfigError(f"drafter.features={cfg.drafter.features!r}: make_batch needs the "
                      f"target's features [S, data.seq_len, target layers, model.d_model] = "
                      f"{want}, got {got}")
  is_context = rows["stream"] == CLEAN
  at = np.where(is_context, rows["pos"], 0)
  feats = np.take_along_axis(np.asarray(context), at[..., None, None], axis=1)
  dtype = jax.numpy.dtype(cfg.model.compute_dtype)
  return np.where(is_context[..., None, None], feats, 0).astype(dtype)


def abstract_batch(cfg: Config, mesh) -> Batch:
  """Shapes, dtypes and shardings of the `Batch` that `make_batch` gives for `cfg`'s global
  batch (`train.batch_size` sequences), without data: for compile-only probes."""
  rows = plan_for(cfg).rows.size
  spec = lambda dtype, *rest: jax.ShapeDtypeStruct((cfg.train.batch_size, rows, *rest), dtype,
                                                   sharding=row_sharding(mesh))
  fields = {f: spec(np.bool_ if f == "maskable" else np.int32) for f in Batch._fields
            if f not in ("context", "kept")}
  if reads_features(cfg):
    fields["context"] = spec(jax.numpy.dtype(cfg.model.compute_dtype),
                             len(target_layer_ids(cfg)), cfg.model.d_model)
  plan = plan_for(cfg)
  if get_objective(cfg.objective.name).DRAFTER and pruned_rows(cfg, plan):
    fields["kept"] = jax.ShapeDtypeStruct(
        (cfg.train.batch_size, plan.num_ranks * context_rows(cfg, plan)), np.int32,
        sharding=row_sharding(mesh))
  return Batch(**fields)
