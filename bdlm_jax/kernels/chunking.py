"""Row chunks: a row-wise function run on a chunk of the rows at a time, so that its
intermediates exist for one chunk only: the attention kernel's query tiles (`kernels/xla.py`)
and a layer's row-wise work under `model.row_chunks` (norms, q/k/v/o projections, RoPE, the
MLP or the experts; `models/transformer.py`), where no [rows, d_ff] intermediate, nor the
float32 copies of q and k that RoPE makes, may exist whole at long context.

The chunks run as a `lax.scan` reading their rows from the whole input by offset (no stacked
copy of it); the first chunk runs before the loop, its sums starting the accumulator, so that
inside `shard_map` the accumulator varies over the mesh axes its sums vary over. Chunks are
contiguous rows of the arrays given: on rows sharded over devices, the caller runs this on
each device's own rows (`parallel/rows.py`), never on the global row axis, which would move
every chunk's rows between devices.
"""

import jax
import jax.numpy as jnp


def _added(acc, rows):
  """`over_row_chunks`' default fold: the chunk's rows added into the running rows."""
  return jax.tree.map(jnp.add, acc, rows)


def over_row_chunks(fn, chunk: int, *xs_BR, remat: bool = False, into=None, fold=_added):
  """`fn(*xs) -> (rows, sums)` over contiguous chunks of `chunk` rows (axis 1 of every array
  in `xs`; None entries pass through), the last one shorter where `chunk` does not divide the
  rows: the chunks' `rows` (a pytree of [B, r, ...]) joined back on the row axis, their
  `sums` (a pytree) added up. Exact where `fn`'s rows depend on their own row alone and its
  sums are sums over rows. `chunk <= 0` runs all rows at once. `remat`: each chunk is
  rematerialised, so a differentiated caller keeps only a chunk's inputs, never its
  intermediates, for the backward.

  Each chunk writes its rows into one buffer of the joined rows in the loop's carry, updated
  in place, rather than the loop stacking them to be joined after it (two copies of the rows
  at once). `into`: arrays shaped as the joined rows that the chunks' rows are folded into
  instead, `fold(into's rows, chunk's rows) -> rows` (default: added), returned as the rows:
  a running sum (dq) or a running softmax (out, lse) over calls, updated a chunk at a time."""
  n = jax.tree.leaves(xs_BR)[0].shape[1]
  if chunk <= 0 or chunk >= n:
    rows, sums = fn(*xs_BR)
    return (rows if into is None else fold(into, rows)), sums
  full, tail = divmod(n, chunk)

  def rows_from(start, size):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1), xs_BR)

  def put(acc, rows, start):
    if into is not None:
      rows = fold(jax.tree.map(lambda a, r: jax.lax.dynamic_slice_in_dim(a, start, r.shape[1],
                                                                       axis=1), acc, rows), rows)
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, start, axis=1),
                        acc, rows)

  run = jax.checkpoint(fn) if remat else fn
  first, sums = run(*rows_from(0, chunk))
  # The buffer starts as the first chunk's rows, padded: inside shard_map it then varies over
  # the mesh axes the rows vary over.
  acc = (jax.tree.map(lambda r: jnp.pad(r, [(0, 0), (0, n - chunk)] + [(0, 0)] * (r.ndim - 2)),
                      first) if into is None else put(into, first, 0))

  def body(carry, i):
    sums, acc = carry
    rows, more = run(*rows_from(i * chunk, chunk))
    return (jax.tree.map(jnp.add, sums, more), put(acc, rows, i * chunk)), None

  (sums, acc), _ = jax.lax.scan(body, (sums, acc), jnp.arange(1, full))
  if tail:
    tail_rows, tail_sums = run(*rows_from(full * chunk, tail))
    acc = put(acc, tail_rows, full * chunk)
    sums = jax.tree.map(jnp.add, sums, tail_sums)
  return acc, sums
