"""Where a mixture-of-experts layer runs: on the rows each device holds.

Under plain jit, GSPMD cannot partition the routing (a sort of every (token, expert) pair and
grouped matmuls over them): it would gather the whole batch's pairs onto every device and
route all of them there. `local_dispatch` runs `models.moe.experts` under `shard_map` on each
device's own rows, with the layer's weights as the layer scan gathered them, and sums the
router statistics (sums over rows by construction) over the row axes.
"""

import jax
from jax.sharding import PartitionSpec as P

from bdlm_jax.parallel.mesh import BATCH_AXES

ROW_AXES = (*BATCH_AXES, "seq")


def local_dispatch(mesh):
  """The `dispatch` hook of `models.moe.MoE` for row-sharded activations on `mesh`."""
  if mesh is None or mesh.size == 1:
    return None

  def dispatch(fn, x_BRD, row_weight_BR, weights):
    def body(x_BRD, row_weight_BR, weights):
      out_BRD, stats = fn(x_BRD, row_weight_BR, weights)
      return out_BRD, jax.lax.psum(stats, ROW_AXES)

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(P(BATCH_AXES, "seq", None), P(BATCH_AXES, "seq"), P()),
                         out_specs=(P(BATCH_AXES, "seq", None), P()))(x_BRD, row_weight_BR,
                                                                      weights)

  return dispatch
