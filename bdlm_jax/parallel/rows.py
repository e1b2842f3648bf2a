"""A layer's row-wise work in parts (`model.row_chunks`) on each device's own rows.

Outside attention the layers run as plain jit code on arrays whose rows are sharded over the
mesh. Cutting the global row axis into chunks would give each chunk to one device and move
its rows there; and a weight's gradient summed over chunks inside a loop would be reduced
across devices once per chunk. So the parts run inside a `shard_map` over the batch and row
axes: every device loops over chunks of its own rows (`models.transformer.in_parts`), the
layer's weights given replicated, and their gradients meet once, at the boundary, in one
reduction per layer, as without chunks.
"""

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from bdlm_jax.models.transformer import RowsFn, in_parts
from bdlm_jax.parallel.mesh import BATCH_AXES


def row_runner(mesh) -> RowsFn:
  """The `rows` hook of the model's layers under `mesh` (`in_parts` on one device)."""
  if mesh is None or mesh.size == 1:
    return in_parts
  rows_spec = P(BATCH_AXES, "seq")

  def run(fn, parts: int, module, *xs_BR):
    if parts == 1:
      return fn(module, *xs_BR)
    graphdef, state = nnx.split(module)

    def per_device(state, *xs_BR):
      rows, sums = in_parts(fn, parts, nnx.merge(graphdef, state), *xs_BR)
      return rows, jax.lax.psum(sums, mesh.axis_names)  # e.g. router statistics

    # The weights enter as arguments (replicated), not closed over: inside shard_map they
    # are then the manual mesh's values, as the chunk loop's gradient accumulators must be.
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), *[rows_spec] * len(xs_BR)),
                         out_specs=(rows_spec, P()))(state, *xs_BR)

  return run
