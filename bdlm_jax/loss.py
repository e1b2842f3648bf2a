"""`loss_fn`: one pure, differentiable function of (params, batch, key) for every strategy.

The strategy only changes how attention is executed (`make_attend`) and the static row
slot where logits are computed; the corruption is drawn in logical coordinates, so the
same (params, batch, key) gives the same loss under every layout.
"""

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config, ConfigError, replace
from bdlm_jax.objectives import ar, bd3lm, fast_dllm_v2, get_objective
from bdlm_jax.params import merge
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.strategies import make_attend, plan_for


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


def loss_fn(params, batch, key, cfg: Config, mesh=None):
  """(loss, metrics): weighted masked-token CE summed over the batch / valid tokens."""
  plan = plan_for(cfg)
  _check_batch(cfg, batch, plan)
  objective = get_objective(cfg.objective.name)
  model = merge(cfg, params)
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
  hidden = model(inputs, batch.pos, batch.meta, make_attend(cfg, mesh))
  slot = objective.LOSS_SLOT
  logits = model.logits(_slot_rows(hidden, plan, slot))
  labels = _slot_rows(batch.labels, plan, slot)
  if objective is not ar:
    total = bd3lm.subs_loss(logits, labels, _slot_rows(masked, plan, slot),
                            _slot_rows(weight, plan, slot), cfg.objective.mask_token_id)
  else:
    total = objective.nll_loss(logits, labels)
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
