"""ZeRO-3 / FSDP: model state sharded over every device of a data replica (fsdp x seq).

Parameters, gradients and both Adam moments are sharded alike (`zero3_shardings`); every
seq rank computes with all the weights, so each layer gathers its weights where it runs
(inside the layer scan, one layer at a time) and returns their gradient to the shards with
one reduce-scatter (`gathered_weights`; XLA:CPU compiles it as an all-reduce and a slice,
which its byte counts then show). `data` stays plain replication.

Only with `model.remat=full` is a layer's gathered copy dropped after its forward (and
gathered again in its backward); without remat the backward keeps every layer's gathered
weights, as it keeps every other activation.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.models.transformer import is_stacked

STATE_AXES = ("fsdp", "seq")


def state_ways(mesh) -> int:
  """Devices one copy of the model state is split over."""
  return int(np.prod([mesh.shape[a] for a in STATE_AXES]))


def param_spec(shape: tuple[int, ...], ways: int, stacked: bool = False) -> P:
  """Placement of one parameter (or its gradient, or an optimiser moment).

  Shards the largest axis that `ways` = fsdp*seq divides over both axes; (per-layer) vectors
  and indivisible tensors stay replicated. The layer axis of stacked layer weights is never
  sharded: the layer scan slices it.
  """
  if ways == 1 or len(shape) - stacked < 2:
    return P()
  for axis in sorted(range(stacked, len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % ways == 0:
      spec = [None] * len(shape)
      spec[axis] = STATE_AXES
      return P(*spec)
  return P()


def zero3_shardings(mesh, tree):
  """NamedShardings for a params-shaped pytree (params, grads, optimiser state)."""
  ways = state_ways(mesh)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(x.shape, ways, is_stacked(path))), tree)


def _gather(w, dtype, whole, shard):
  """`w` cast to `dtype`, then gathered; its gradient reduce-scattered in w's dtype."""
  param_dtype = w.dtype

  @jax.custom_vjp
  def gather(w):
    return jax.lax.with_sharding_constraint(w.astype(dtype), whole)

  def fwd(w):
    return gather(w), None

  def bwd(_, g):
    # Constraining the cotangent to the shard layout makes the partial sums of every device
    # meet in one reduce-scatter (a replicated cotangent would be all-reduced first).
    return (jax.lax.with_sharding_constraint(g.astype(param_dtype), shard),)

  gather.defvjp(fwd, bwd)
  return gather(w)


def gathered_weights(mesh=None, dtype=None):
  """The hook that prepares weights where they are used: one layer's inside the layer scan,
  the embedding and head once per step.

  Matrices are cast to `dtype` (if given) *before* they are gathered, so the all-gather moves
  compute-dtype bytes while the master copy stays in `param_dtype`; their gradient is
  reduce-scattered back to the shards in `param_dtype`. Vectors (norm scales) are left alone.
  """
  cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
  if mesh is None:
    return lambda weights: jax.tree.map(lambda w: cast(w) if w.ndim >= 2 else w, weights)
  ways, whole = state_ways(mesh), NamedSharding(mesh, P())

  def one(w):
    if w.ndim < 2:
      return w
    return _gather(w, w.dtype if dtype is None else dtype, whole,
                   NamedSharding(mesh, param_spec(w.shape, ways)))

  return lambda weights: jax.tree.map(one, weights)
