"""`loss_fn`: one pure, differentiable function of (params, batch, key) for every strategy.

The strategy only changes how attention is executed (`make_attend`) and the static row
slot where logits are computed; the corruption is drawn in logical coordinates, so the
same (params, batch, key) gives the same loss under every layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config, ConfigError, replace
from bdlm_jax.objectives import ar, bd3lm, fast_dllm_v2, get_objective
from bdlm_jax.params import merge
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.strategies import make_attend, plan_for
from bdlm_jax.parallel.zero3 import compute_weights


def _slot_rows(x_SR, plan, slot: str):
  """The rows of every rank's noisy (or clean) slot: [S, P * slot_rows, ...]."""
  s = x_SR.shape[0]
  x = x_SR.reshape(s, plan.num_ranks, plan.rows_per_rank, *x_SR.shape[2:])
  x = x[:, :, :plan.n_noisy] if slot == "noisy" else x[:, :, plan.n_noisy:]
  return x.reshape(s, -1, *x_SR.shape[2:])


def _check_batch(cfg, batch, plan):
  rows = batch.tokens.shape[1]
  want = plan.num_ranks * plan.rows_per_rank
  if rows != want:
    raise ConfigError(f"batch has {rows} rows but strategy {cfg.parallel.strategy!r} with "
                      f"L={cfg.data.seq_len}, seq={plan.num_ranks} lays out {want}: build it "
                      f"with make_batch(cfg, ...) using the same config")


def chunked_loss(logits_fn, score_fn, chunk: int, num_ranks: int, h_SND, labels_SN, take_SN,
                 weight_SN):
  """`score_fn(logits, labels, take, weight)` summed over chunks of `chunk` rows per rank.

  Only one chunk's float32 logits [S, P, chunk, vocab] exist at a time, never [rows, vocab]:
  the chunks run as a `lax.scan` whose body is rematerialised, so the backward recomputes
  each chunk's logits instead of saving them. The rank axis P stays whole, so every rank
  scores its own rows (no resharding). `chunk <= 0` scores all rows at once.
  """
  s, n = h_SND.shape[:2]
  per_rank = n // num_ranks
  c = per_rank if chunk <= 0 else min(chunk, per_rank)
  k = -(-per_rank // c)

  def split(x, pad_value):  # [S, P * per_rank, ...] -> [k, S, P, c, ...]
    x = x.reshape(s, num_ranks, per_rank, *x.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, 0), (0, k * c - per_rank)] + [(0, 0)] * (x.ndim - 3),
                constant_values=pad_value)
    return jnp.moveaxis(x.reshape(s, num_ranks, k, c, *x.shape[3:]), 2, 0)

  @jax.checkpoint
  def body(total, xs):
    h, labels, take, weight = xs
    return total + score_fn(logits_fn(h), labels, take, weight), None

  xs = (split(h_SND, 0), split(labels_SN, -1), split(take_SN, False), split(weight_SN, 0))
  return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


def loss_fn(params, batch, key, cfg: Config, mesh=None):
  """(loss, metrics): weighted masked-token CE summed over the batch / valid tokens."""
  plan = plan_for(cfg)
  _check_batch(cfg, batch, plan)
  objective = get_objective(cfg.objective.name)
  prepare = compute_weights(cfg, mesh)
  model = merge(cfg, {**prepare({k: v for k, v in params.items() if k != "layers"}),
                      "layers": params["layers"]})
  if mesh is not None:
    batch = jax.lax.with_sharding_constraint(batch, row_sharding(mesh))
  n_valid = jnp.sum(batch.labels >= 0)  # before fast_dllm_v2 doubles the batch
  if objective is bd3lm:
    inputs, masked, weight = bd3lm.corrupt(key, batch, cfg.data.seq_len, cfg.objective)
  elif objective is fast_dllm_v2:  # two complementary copies: 2S sequences, unit weights
    batch, inputs, masked = fast_dllm_v2.corrupt(key, batch, cfg.data.seq_len, cfg.objective)
    weight = jnp.ones(masked.shape)
  else:
    inputs, masked, weight = batch.tokens, batch.labels >= 0, jnp.ones(batch.labels.shape)
  hidden = model(inputs, batch.pos, batch.meta, make_attend(cfg, mesh), layer_weights=prepare)
  if objective is ar:
    score = lambda logits, labels, take, weight: ar.nll_loss(logits, labels)
  else:
    score = functools.partial(bd3lm.subs_loss, mask_token_id=cfg.objective.mask_token_id)
  rows = [_slot_rows(x, plan, objective.LOSS_SLOT) for x in (hidden, batch.labels, masked, weight)]
  total = chunked_loss(model.logits, score, cfg.model.logits_chunk, plan.num_ranks, *rows)
  loss = total / jnp.maximum(n_valid, 1)
  metrics = dict(loss=loss, valid_tokens=n_valid,
                 masked_tokens=jnp.sum(masked & (batch.labels >= 0)))
  return loss, metrics


def ar_logits(params, cfg: Config, tokens) -> jax.Array:
  """Plain causal forward of logical tokens [S, L] -> float32 logits [S, L, vocab].

  For interop and evaluation: the layout is built on the host, so `tokens` is concrete
  (jit the model inside, not this function over `tokens`)."""
  ar_cfg = replace(cfg, objective=dict(name="ar"), parallel=dict(strategy="none", seq=1),
                   data=dict(seq_len=int(np.shape(tokens)[1])))
  batch = make_batch(ar_cfg, np.asarray(tokens))
  model = merge(ar_cfg, params)
  hidden = model(batch.tokens, batch.pos, batch.meta, make_attend(ar_cfg))
  return model.logits(hidden)
