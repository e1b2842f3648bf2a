"""DFlash drafter training (docs/dflash.md): anchors, `[x_a, MASK ...]` draft blocks,
position-decayed cross-entropy.

The logical rows are `[draft ; context]`: `max_anchors` A draft blocks of B rows, then the L
clean context rows, whose tokens feed the frozen target (its hidden states become the
drafter's context). The section-2 mask expresses the drafter's with row metadata alone:
* context row p: CLEAN, block p (blocks of one position, as `ar`): keys only;
* draft row k of anchor a: NOISY, block a, position a + k. A noisy query sees noisy keys of
  its own block (its draft block, bidirectionally) and clean keys of strictly earlier
  blocks, i.e. the context positions before a, within its document (segment ids).
Anchors are positions a where a and a + 1 are supervised tokens (not padding, not protected)
of one document; slot k >= 1 predicts x_{a+k} (when it is a supervised token of a's
document) with weight exp(-(k-1)/gamma); slot 0 is not scored.

Anchors are drawn on the host, in logical coordinates, sorted by position, from the step's
key (`make_batch(..., key=)`, which the training loop passes: a sequence gets new anchors every
step, as the seed's generator advances each batch, core/objectives/dflash.py ~116-117), or,
without a key (held-out evaluation, `draft_logits`), from a generator seeded by the batch's own
tokens, so a batch always gets the same anchors. Either way every layout, and every process
that holds the batch, draws the same ones, and `make_batch` checks context pruning's capacity against the anchors
drawn. Sorted anchors make draft block j's context grow with j, which is what the layouts
balance (dual-end pairs, as BD3-LM's blocks).
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels.mask import CLEAN, NOISY
from bdlm_jax.models import drafter as drafter_lib
from bdlm_jax.models.drafter import drafter_model, target_depth, target_layer_ids
from bdlm_jax.models.pattern import layer_types
from bdlm_jax.objectives.base import count_labels, no_first_pass, no_step_counts
from bdlm_jax.objectives import dflash2
from bdlm_jax.objectives.bd3lm import token_nll
from bdlm_jax.objectives.dflash2 import dpace_weights  # noqa: F401 (public API)

NAME = "dflash"
LOSS_SLOT = "noisy"  # the draft rows
NOISY_STREAM = True
COPIES = 1
TOKEN_SHIFT = False
DRAFTER = True  # a drafter over a frozen target (models/drafter.py)
SAMPLER = ""
BLOCK_IDS = "position"  # a draft block holds its anchor
MASK_TOKEN = True
FROZEN = (drafter_lib.FROZEN,)  # the target
HELD_OUT = (f"{NAME} loss", "")  # its training loss: no likelihood bound
FREEZE = ""
ATTEND_ROWS = ("clean", "draft")  # the target over the context; the drafter's draft rows
normalizer = count_labels
first_passes = no_first_pass
step_counts = no_step_counts


def check_config(cfg: Config) -> None:
  """Draft blocks start at anchors, anywhere: no block multiple, but a drafter's own rules."""
  m, o, d = cfg.model, cfg.objective, cfg.drafter
  if cfg.data.seq_len < o.block_size:
    raise ConfigError(f"data.seq_len={cfg.data.seq_len} is shorter than one draft block "
                      f"(objective.block_size={o.block_size})")
  if o.block_size < 2:
    raise ConfigError(f"objective.block_size={o.block_size}: a draft block needs its anchor "
                      f"and at least one slot to predict (>= 2)")
  ids = target_layer_ids(cfg)
  bad = [i for i in ids if not 0 <= i < m.n_layers]
  if bad:
    raise ConfigError(f"drafter.target_layers {bad} lie outside the target's layers "
                      f"[0, model.n_layers={m.n_layers})")
  if len(set(ids)) != len(ids):
    raise ConfigError(f"drafter.target_layers={d.target_layers!r} names a layer twice")
  if set(layer_types(m)) != {"global"} or m.moe_experts:
    raise ConfigError("objective=dflash takes a dense, all-global target for now "
                      "(model.layer_pattern='global', model.moe_experts=0)")
  if d.features and o.draft_loss == "kl":
    raise ConfigError(f"objective.draft_loss='kl' needs the target's final hidden states, "
                      f"which drafter.features={d.features!r} does not hold; use "
                      f"draft_loss='ce' or co-host the target (drafter.features='')")
  if d.features and cfg.train.eval_every:
    raise ConfigError(f"drafter.features={d.features!r} holds training sequences only: "
                      f"held-out evaluation needs the target, so set train.eval_every=0")
  if (o.lk_loss or o.selector_rank) and not o.dflash_loss:
    raise ConfigError(f"objective.lk_loss={o.lk_loss!r} and objective.selector_rank="
                      f"{o.selector_rank} are DFlash2's: set objective.dflash_loss (dflash, "
                      f"dpace, ...), whose weights and denominator they share")
  if o.dflash_loss and o.draft_loss != "ce":
    raise ConfigError(f"objective.dflash_loss={o.dflash_loss!r} scores hard-label CE on the "
                      f"data's tokens (its p = exp(-CE)); draft_loss={o.draft_loss!r} is not "
                      f"that: use draft_loss='ce'")
  if o.dflash_loss and cfg.train.grad_accum > 1:
    raise ConfigError(f"objective.dflash_loss={o.dflash_loss!r} divides by the sum of the whole "
                      f"batch's weights (D-PACE's read its predictions), which micro-batches "
                      f"cannot share: set train.grad_accum=1 (got {cfg.train.grad_accum})")
  if o.selector_rank and not 1 <= o.selector_top_k <= m.vocab_size:
    raise ConfigError(f"objective.selector_top_k={o.selector_top_k} must lie in [1, "
                      f"model.vocab_size={m.vocab_size}]")
  if d.sliding_causal and not d.window:
    raise ConfigError("drafter.sliding_causal=true makes the draft block causal on sliding-"
                      "window layers, and the drafter has none: set drafter.window > 0")
  if d.window and d.window < o.block_size:
    raise ConfigError(f"drafter.window={d.window} must be >= objective.block_size="
                      f"{o.block_size}: a draft slot sees its whole block")
  if d.conv_taps and (d.conv_taps > o.block_size or m.d_model % d.conv_group_size):
    raise ConfigError(f"drafter.conv_taps={d.conv_taps} must be <= objective.block_size="
                      f"{o.block_size} and drafter.conv_group_size={d.conv_group_size} must "
                      f"divide model.d_model={m.d_model}")
  dm = drafter_model(cfg)
  if dm.n_heads % dm.n_kv_heads or dm.head_dim % 2:
    raise ConfigError(f"the drafter's heads ({dm.n_heads} query, {dm.n_kv_heads} key/value, "
                      f"head_dim {dm.head_dim}) need query heads a multiple of key/value heads "
                      f"and an even head_dim")


def hidden(spec, model, batch, inputs, layer_weights):
  """Final drafter hidden states of the draft rows (each rank's noisy slot), and for a KL
  loss (`objective.draft_loss=kl`) the target's final hidden states that score them.

  The frozen target runs causally over the context rows (each rank's clean slot, where
  they already are) and hands the drafter its hidden states at the chosen layers; or the
  batch brings those states, precomputed (`drafter.features`), and the target does not run.
  Draft slot k of anchor a is scored against the target's prediction at position a + k - 1,
  which is fetched from whichever rank holds it (one gather of the rows, not per layer)."""
  cfg, plan = spec.cfg, spec.plan
  draft = functools.partial(plan.slot_rows, slot="noisy")
  ctx = functools.partial(plan.slot_rows, slot="clean")
  draft_meta, ctx_meta = jax.tree.map(draft, batch.meta), jax.tree.map(ctx, batch.meta)
  target, attend = model.target, spec.attend["draft"]
  if batch.context is not None:  # a rank's rows: its draft rows' zeros, then its context's
    feats, skip = batch.context, plan.n_noisy
  elif cfg.drafter.features:
    raise ConfigError(f"drafter.features={cfg.drafter.features!r}: the target has no layers "
                      f"here, so the batch must bring its features (make_batch(..., context=))")
  else:
    feats, final = target.features(ctx(inputs), ctx(batch.pos), ctx_meta, spec.attend["clean"],
                                   target_layer_ids(cfg), target_depth(cfg), layer_weights,
                                   spec.rows)
    skip = 0
  if cfg.drafter.conv_taps:
    _check_whole_blocks(plan)
  if attend.prune is not None:  # only the context rows some draft window reaches
    ctx_meta, feats = attend.prune(batch.kept, ctx_meta, feats, skip=skip)
  elif skip:
    feats = ctx(feats)
  out = model.drafter(target.embed_tokens(draft(inputs)), draft(batch.pos), draft_meta,
                      feats, ctx_meta.pos, ctx_meta, attend, layer_weights,
                      spec.rows)
  if cfg.objective.draft_loss != "kl":
    return out, (), {}
  source = jnp.asarray(plan.context_rows)[jnp.clip(draft(batch.pos) - 1, 0, plan.seq_len - 1)]
  teacher = jnp.take_along_axis(final, source[..., None], axis=1)
  return out, (spec.rows_sharded(teacher),), {}


def _check_whole_blocks(plan) -> None:
  """The block convolution reads each rank's draft rows as whole blocks in slot order."""
  rows = dflash2.draft_index(plan).reshape(-1, plan.block_size)
  padding = (rows == plan.draft_blocks * plan.block_size).all(axis=1)
  whole = (rows % plan.block_size == np.arange(plan.block_size)).all(axis=1) & (
      rows // plan.block_size == rows[:, :1] // plan.block_size).all(axis=1)
  if not (whole | padding).all():
    raise ConfigError(f"drafter.conv_taps needs whole draft blocks on each rank; strategy "
                      f"{plan.strategy!r} splits them (its {plan.draft_blocks} draft blocks "
                      f"of {plan.block_size} rows in 2 x {plan.num_ranks} chunks): choose "
                      f"objective.max_anchors a multiple of 2 x parallel.seq")


def rows_loss(spec, model, batch, hidden_SND, scored_SR, weight_SR):
  """DFlash2's losses (`objective.dflash_loss` set) weigh each slot by its block's others, so
  they score the draft rows as a whole (`dflash2.rows_loss`); None: the per-chunk `score`."""
  if not spec.cfg.objective.dflash_loss:
    return None
  return dflash2.rows_loss(spec, model, batch, hidden_SND, scored_SR, weight_SR)


def evaluated(cfg: ObjectiveConfig, t_min: float) -> dict:
  del cfg, t_min
  return {}


def anchor_candidates(seg_SL, protected_SL) -> np.ndarray:
  """bool [S, L]: a and a+1 are supervised tokens of one document."""
  sup = (seg_SL > 0) & ~protected_SL
  ok = np.zeros(seg_SL.shape, bool)
  ok[:, :-1] = sup[:, :-1] & sup[:, 1:] & (seg_SL[:, :-1] == seg_SL[:, 1:])
  return ok


def pick_anchors(ok_SL, max_anchors: int, sampling: str, seed: int,
                 block_size: int = 1) -> list[np.ndarray]:
  """Sorted anchor positions per sequence: up to `max_anchors` of the candidates, drawn
  uniformly without replacement, strided (evenly spread over the candidates), or by the
  seed's `locality` (`_sample_locality_anchors`, objectives/dflash.py ~450-510): a stride of
  B candidates, bumped until coprime with their count n, from a uniform start, (start + i
  stride) mod n: a run of nearby anchors (wrapping), each slot uniform over the candidates."""
  rng = np.random.default_rng(seed)
  out = []
  for ok in ok_SL:
    cand = np.flatnonzero(ok)
    n = min(max_anchors, len(cand))
    if sampling == "uniform":
      idx = np.sort(rng.choice(len(cand), n, replace=False))
    elif sampling == "locality":
      stride = max(1, block_size)
      while len(cand) and math.gcd(stride, len(cand)) != 1:
        stride += 1
      start = rng.integers(len(cand)) if len(cand) else 0
      idx = np.sort((start + np.arange(n) * stride) % max(len(cand), 1))
    else:
      idx = ((np.arange(n) + 0.5) * len(cand) / max(n, 1)).astype(np.int64)
    out.append(cand[idx])
  return out


def locality_run(seq_len: int, anchors: int, block_size: int) -> np.ndarray:
  """Where static costs put `pick_anchors`' locality anchors among the n = L - 1 candidates
  of one supervised document: its run of stride B (bumped until coprime with n), started
  mid-sequence (no wrap)."""
  n, stride = seq_len - 1, block_size
  while math.gcd(stride, n) != 1:
    stride += 1
  start = (n - anchors * stride) // 2
  return np.sort((start + np.arange(anchors) * stride) % n)


ANCHOR_STREAM = 0x616E63  # "anc": the anchors' draw from a step's key, apart from its others


def anchor_seed(tokens_SL, seg_SL, key=None):
  """The anchors' generator seed: the step's `key` (its bits after ANCHOR_STREAM, on the
  host), or without one a hash of the batch's tokens and documents (the same batch, the same
  anchors)."""
  if key is None:
    return zlib.crc32(np.ascontiguousarray(tokens_SL, np.int32).tobytes()
                      + np.ascontiguousarray(seg_SL, np.int32).tobytes())
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)  # else a raw uint32 key (jax.random.PRNGKey)
  return [ANCHOR_STREAM, *(int(x) for x in np.asarray(key).ravel())]


def logical_rows(tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig, key=None) -> dict:
  """The logical rows `[draft ; context]`; the anchors drawn from `key` (`anchor_seed`)."""
  s, l = tokens_SL.shape
  a_count, b = cfg.max_anchors, cfg.block_size
  seed = anchor_seed(tokens_SL, seg_SL, key)
  anchors = pick_anchors(anchor_candidates(seg_SL, protected_SL), a_count, cfg.anchors, seed, b)
  valid_SA = np.zeros((s, a_count), bool)
  anchor_SA = np.zeros((s, a_count), np.int64)
  for i, a in enumerate(anchors):
    valid_SA[i, :len(a)], anchor_SA[i, :len(a)] = True, a
  k_B = np.arange(b)
  pos_SAB = anchor_SA[..., None] + k_B  # may run past L - 1 (RoPE only); never read there
  inside = (pos_SAB < l) & valid_SA[..., None]
  at = np.minimum(pos_SAB, l - 1)
  take = lambda x: np.take_along_axis(x, at.reshape(s, -1), 1).reshape(at.shape)
  seg_a = np.take_along_axis(seg_SL, anchor_SA, 1)[..., None]
  same_doc = inside & (take(seg_SL) == seg_a)
  scored = same_doc & (k_B >= 1) & ~take(protected_SL)
  draft = dict(
      tokens=np.where(same_doc, take(tokens_SL), 0), labels=np.where(scored, take(tokens_SL), -1),
      maskable=valid_SA[..., None] & (k_B >= 1), pos=pos_SAB,
      block=anchor_SA[..., None],
      seg=np.where(valid_SA[..., None], seg_a, 0), stream=np.full(pos_SAB.shape, NOISY))
  pos_SL = np.broadcast_to(np.arange(l), (s, l))
  context = dict(tokens=tokens_SL, labels=np.full((s, l), -1), maskable=np.zeros((s, l), bool),
                 pos=pos_SL, block=pos_SL, seg=seg_SL, stream=np.full((s, l), CLEAN))
  dtypes = dict(maskable=bool)
  flat = lambda x: np.broadcast_to(x, pos_SAB.shape).reshape(s, -1)
  return {name: np.concatenate([flat(draft[name]), context[name]], 1).astype(
      dtypes.get(name, np.int32)) for name in draft}


def corrupt(key, batch, cfg: Config, counts=None):
  """Nothing random: every draft slot but the anchor is [MASK]; slot k = pos - block of a
  scored row has weight exp(-(k-1)/gamma)."""
  del counts  # the loss is divided by `normalizer`
  del key
  o = cfg.objective
  inputs = jnp.where(batch.maskable, o.mask_token_id, batch.tokens)
  slot = (batch.pos - batch.block).astype(jnp.float32)
  return batch, inputs, batch.labels >= 0, jnp.exp(-(slot - 1.0) / o.gamma)


def score(logits_SNV, labels_SN, scored_SN, weight_SN, teacher_SNV=None, *, cfg=None):
  """Summed weighted loss of the scored draft slots: cross-entropy to the data's tokens, or,
  given the target's logits at the same slots (`objective.draft_loss=kl`), the KL divergence
  KL(target || drafter) of the two next-token distributions."""
  del cfg
  if teacher_SNV is None:
    per_row = token_nll(logits_SNV, labels_SN)
  else:
    target = jax.nn.log_softmax(teacher_SNV, axis=-1)
    drafter = jax.nn.log_softmax(logits_SNV, axis=-1)
    per_row = jnp.sum(jnp.exp(target) * (target - drafter), axis=-1)
  return jnp.sum(jnp.where(scored_SN, weight_SN * per_row, 0.0))
