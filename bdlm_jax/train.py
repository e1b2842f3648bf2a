"""The functional train step (`make_train_step`) and the state it updates.

`train_step(state, batch, key)` is pure: the loop, logging and checkpoints live in loop.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.loss import spec_loss
from bdlm_jax.optimizer import learning_rate, make_optimizer
from bdlm_jax.params import abstract_params, init_params, join, split_frozen
from bdlm_jax.parallel.mesh import row_sharding
from bdlm_jax.parallel.zero3 import zero3_shardings
from bdlm_jax.spec import StepSpec, resolve


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar
  params: dict  # every parameter, a drafter's frozen target included
  opt_state: optax.OptState  # of the trainable parameters only (`split_frozen`)


def state_shardings(cfg: Config, mesh):
  """Parameters and every optimiser moment sharded alike over fsdp*seq; scalars replicated."""
  return zero3_shardings(mesh, _state_shapes(cfg), cfg.parallel.expert_axis_names)


def abstract_state(cfg: Config, mesh) -> TrainState:
  """Shapes, dtypes and shardings of the train state, without allocating it (for restore)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      _state_shapes(cfg), state_shardings(cfg, mesh))


def _state_shapes(cfg: Config) -> TrainState:
  return jax.eval_shape(lambda: _fresh_state(cfg, abstract_params(cfg)))


def _fresh_state(cfg: Config, params) -> TrainState:
  trainable, _ = split_frozen(cfg, params)
  return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(cfg.train).init(trainable))


def init_state(cfg: Config, key, mesh, params=None) -> TrainState:
  """A fresh state around random params drawn from `key`, or around `params` if given."""
  params = init_params(cfg, key, mesh) if params is None else params
  return jax.jit(lambda p: _fresh_state(cfg, p), out_shardings=state_shardings(cfg, mesh))(params)


PEAK_METRICS = ("moe_max_load",)
SHARES = ("loss", "token_loss")  # what a micro-batch's loss holds of the step's


def _accumulated_grads(spec: StepSpec, params, frozen, batch, key):
  """Gradient of (sum of token losses) / (valid tokens) over `grad_accum` micro-batches (plus
  an MoE's router losses, each micro-batch's weighted by its valid tokens), with respect to
  the trainable `params`; the `frozen` ones are held fixed. An objective with `step_counts`
  divides by the whole step's counts in each micro-batch: their losses and gradients add up
  to the one big batch's."""
  cfg, mesh = spec.cfg, spec.mesh
  n = cfg.train.grad_accum
  counts = spec.objective.step_counts(batch) or None
  grad_fn = jax.value_and_grad(
      lambda p, b, k: spec_loss(spec, join(p, frozen), b, k, counts), has_aux=True)
  if n == 1:
    (loss, metrics), grads = grad_fn(params, batch, key)
    return grads, metrics
  # Micro-batch i takes sequences i, i + n, ...: every device keeps feeding its own sequences
  # (contiguous slices would move the batch between devices with an all-to-all).
  micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                       batch)

  shards = zero3_shardings(mesh, params, cfg.parallel.expert_axis_names)

  def body(carry, xs):
    grads_sum, totals, count, masked = carry
    i, mb = xs
    mb = jax.lax.with_sharding_constraint(mb, row_sharding(mesh))
    (_, m), g = grad_fn(params, mb, jax.random.fold_in(key, i))
    g = jax.lax.with_sharding_constraint(g, shards)  # accumulate shards, never whole grads
    v = m["valid_tokens"].astype(jnp.float32)
    w = 1.0 if counts else v  # a share of the step's loss already, or a mean to weigh
    grads_sum = jax.tree.map(lambda a, b: a + w * b, grads_sum, g)
    totals = {k: t + (w if k in SHARES else v) * m[k] for k, t in totals.items()}
    return (grads_sum, totals, count + v, masked + m["masked_tokens"]), {
        k: m[k] for k in m.keys() & PEAK_METRICS}

  # Every per-token metric (the loss, router losses) is averaged by valid tokens, as the loss;
  # counts are summed, and ratios (the expert load) give their largest micro-batch value.
  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), key)[0][1]
  totals = {k: jnp.zeros_like(v) for k, v in shapes.items()
            if k not in ("valid_tokens", "masked_tokens", *PEAK_METRICS)}
  init = (jax.tree.map(jnp.zeros_like, params), totals, jnp.float32(0), jnp.int32(0))
  (grads, totals, count, masked), peaks = jax.lax.scan(body, init, (jnp.arange(n), micro))
  count = jnp.maximum(count, 1.0)
  shared = 1.0 if counts else count
  grads = jax.tree.map(lambda g: g / shared, grads)
  return grads, dict({k: t / (shared if k in SHARES else count) for k, t in totals.items()},
                     **{k: p.max() for k, p in peaks.items()},
                     valid_tokens=count.astype(jnp.int32), masked_tokens=masked)


def _all_finite(tree) -> jax.Array:
  return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]).all()


def is_finite(state: TrainState) -> bool:
  """Whether every weight and optimiser moment is finite, as every state a checkpoint is
  written from is (`make_train_step` applies no other)."""
  return bool(jax.jit(_all_finite)(state))


# An update whose global norm exceeds MAX_UPDATE_RATIO x the global norm of the weights it
# updates is not applied: it replaces the weights rather than trains them. AdamW moves each
# weight by about the learning rate, so normal steps are ~lr / rms(weight) (~0.01-0.3 at
# lr 1e-3-1e-2 on this package's inits); lr=1e30 gives ~1e31.
MAX_UPDATE_RATIO = 1.0


def make_train_step(cfg: Config, mesh):
  """A jitted `train_step(state, batch, key) -> (state, metrics)` on `mesh`.

  A step whose loss, gradients or resulting state are not finite, or whose update is over
  MAX_UPDATE_RATIO x the weights' norm, is not applied: it returns the state unchanged and
  `metrics["skipped"] = 1`, so a bad batch or a blow-up never reaches a checkpoint (loop.py
  stops after `train.max_bad_steps` in a row). Not `optax.apply_if_finite`: it checks only
  the gradients, applies a non-finite update once its budget is spent, and adds its counters
  to the optimiser state that checkpoints hold. `update_ratio` (||update|| / ||weights||) and
  `param_norm` (of the new weights) are what loop.py judges a checkpoint by.
  """
  optimizer = make_optimizer(cfg.train)
  schedule = learning_rate(cfg.train)
  spec = resolve(cfg, mesh)  # the traced step closes over what the config decided

  def train_step(state: TrainState, batch, key):
    params, frozen = split_frozen(cfg, state.params)
    grads, metrics = _accumulated_grads(spec, params, frozen, batch, key)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    stepped = optax.apply_updates(params, updates)
    new = TrainState(state.step + 1, join(stepped, frozen), opt_state)
    grad_norm = optax.tree.norm(grads)
    update_ratio = optax.tree.norm(updates) / optax.tree.norm(params)
    ok = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm) & _all_finite(new)
          & (update_ratio <= MAX_UPDATE_RATIO))
    metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step),
                   update_ratio=update_ratio, param_norm=optax.tree.norm(stepped),
                   skipped=(~ok).astype(jnp.int32))
    return jax.tree.map(lambda n, old: jnp.where(ok, n, old), new, state), metrics

  state_sh = state_shardings(cfg, mesh)
  replicated = NamedSharding(mesh, P())
  return jax.jit(train_step, in_shardings=(state_sh, row_sharding(mesh), replicated),
                 out_shardings=(state_sh, replicated), donate_argnums=(0,))
