"""ZeRO-3 / FSDP: model state sharded over every device of a data replica (fsdp x seq).

Parameters, gradients and both Adam moments are sharded alike (`zero3_shardings`); every
seq rank computes with all the weights, so each layer gathers its weights where it runs
(inside the layer scan, one layer at a time) and returns their gradient to the shards with
one reduce-scatter (`gathered_weights`; XLA:CPU compiles it as an all-reduce and a slice,
which its byte counts then show). `data` stays plain replication.

Expert weights of an MoE under expert parallelism (`parallel.expert_axes`) keep their expert
axis split over those axes, in the state and where they are used alike: only their other
axes are ZeRO-3 sharded (over the state axes not used for experts) and gathered.

Only with `model.remat=full` is a layer's gathered copy dropped after its forward (and
gathered again in its backward); without remat the backward keeps every layer's gathered
weights, as it keeps every other activation.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.models.moe import is_expert_weight
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


def expert_spec(shape: tuple[int, ...], mesh, axes: tuple[str, ...], stacked: bool = False) -> P:
  """Placement of one expert weight [(layers,) E, ...] split over expert `axes`: E over them,
  and the largest other axis that the remaining state axes divide over those."""
  spec = [None] * len(shape)
  spec[stacked] = axes
  rest = tuple(a for a in STATE_AXES if a not in axes)
  ways = int(np.prod([mesh.shape[a] for a in rest]))
  for axis in sorted(range(stacked + 1, len(shape)), key=lambda a: -shape[a]):
    if ways > 1 and shape[axis] % ways == 0:
      spec[axis] = rest
      break
  return P(*spec)


def _spec(mesh, path, shape, expert_axes, stacked) -> P:
  if expert_axes and is_expert_weight(path):
    return expert_spec(shape, mesh, expert_axes, stacked)
  return param_spec(shape, state_ways(mesh), stacked)


def zero3_shardings(mesh, tree, expert_axes: tuple[str, ...] = ()):
  """NamedShardings for a params-shaped pytree (params, grads, optimiser state)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, _spec(mesh, path, x.shape, expert_axes,
                                                is_stacked(path))), tree)


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


def gathered_weights(mesh=None, dtype=None, expert_axes: tuple[str, ...] = ()):
  """The hook that prepares weights where they are used: one layer's inside the layer scan,
  the embedding and head once per step.

  Matrices are cast to `dtype` (if given) *before* they are gathered, so the all-gather moves
  compute-dtype bytes while the master copy stays in `param_dtype`; their gradient is
  reduce-scattered back to the shards in `param_dtype`. Vectors (norm scales) are left alone.
  Expert weights split over `expert_axes` are gathered over the other axes only.
  """
  cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
  if mesh is None:
    return lambda weights: jax.tree.map(lambda w: cast(w) if w.ndim >= 2 else w, weights)

  def one(path, w):
    if w.ndim < 2:
      return w
    split = bool(expert_axes) and is_expert_weight(path)
    whole = P(expert_axes) if split else P()
    return _gather(w, w.dtype if dtype is None else dtype, NamedSharding(mesh, whole),
                   NamedSharding(mesh, _spec(mesh, path, w.shape, expert_axes, False)))

  return lambda weights: jax.tree_util.tree_map_with_path(one, weights)
