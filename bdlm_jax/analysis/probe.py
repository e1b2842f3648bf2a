"""Deterministic costs of one attention layer under a strategy, read from its compiled program.

The program is the real training path: `make_attend(cfg, mesh)` (the strategy's layout plan and
transport) applied to q/k/v in layout order (row metadata from `make_batch`), differentiated
with `jax.grad`. Only compiled figures are reported (collective bytes, memory, flops), so they
hold on simulated CPU devices and are the same on every run. Use float32 on CPU: XLA:CPU runs
bf16 collectives in f32, so bf16 traffic would read double.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import RowMeta
from bdlm_jax.analysis import hlo_stats
from bdlm_jax.parallel.mesh import BATCH_AXES, make_mesh, row_sharding
from bdlm_jax.parallel.strategies import make_attend


def layer_config(strategy: str, seq_len: int, num_ranks: int, block_size: int, *,
                 n_heads: int, n_kv_heads: int, head_dim: int, impl: str = "xla",
                 chunk: int = 512) -> Config:
  """The smallest Config that pins down one BD3-LM attention layer on a seq axis of P ranks."""
  return replace(Config(), data=dict(seq_len=seq_len), objective=dict(block_size=block_size),
                 parallel=dict(strategy=strategy, seq=num_ranks),
                 model=dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                            attention_impl=impl, attention_chunk=chunk))


def _layer(strategy, seq_len, num_ranks, block_size, *, n_heads=4, n_kv_heads=2, head_dim=32,
           batch=1, dtype=jnp.float32, impl="xla", chunk=512, window=None):
  """(grad_fn, arg_shapes, meta): the program and its abstract, sharded arguments."""
  cfg = layer_config(strategy, seq_len, num_ranks, block_size, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, head_dim=head_dim, impl=impl, chunk=chunk)
  mesh = make_mesh(cfg)
  attend = make_attend(cfg, mesh)
  meta = make_batch(cfg, np.ones((batch, seq_len), np.int32)).meta
  rows = meta.stream.shape[1]
  heads = NamedSharding(mesh, P(BATCH_AXES, "seq", None, None))
  shape = lambda h: jax.ShapeDtypeStruct((batch, rows, h, head_dim), dtype, sharding=heads)
  meta_shape = jax.ShapeDtypeStruct((batch, rows), np.int32, sharding=row_sharding(mesh))
  arg_shapes = (shape(n_heads), shape(n_kv_heads), shape(n_kv_heads), shape(n_heads),
                RowMeta(*[meta_shape] * len(RowMeta._fields)))

  def loss(q, k, v, w, meta):
    return (attend(q, k, v, meta, meta, window=window)[0] * w).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), arg_shapes, meta


def attention_layer_program(strategy: str, seq_len: int, num_ranks: int, block_size: int, *,
                            seed: int = 0, **options):
  """(grad_fn, args): jitted grads of `sum(attend(q, k, v)[0] * w)` w.r.t. (q, k, v).

  `args = (q, k, v, w, meta)` are real arrays (q, k, v, w standard normal) in the strategy's
  layout, row-sharded over the `seq` axis of `make_mesh(cfg)`, so `grad_fn(*args)` can be
  timed. `options`: n_heads=4, n_kv_heads=2, head_dim=32, batch=1, dtype=float32,
  impl="xla", chunk=512 (keys per step of the flash loop), window=None (W: a local layer).
  """
  grad_fn, shapes, meta = _layer(strategy, seq_len, num_ranks, block_size, **options)
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, w = (jax.device_put(jax.random.normal(key, s.shape, s.dtype), s.sharding)
                for key, s in zip(keys, shapes[:4]))
  return grad_fn, (q, k, v, w, jax.device_put(meta, shapes[4].stream.sharding))


def attention_layer_costs(strategy: str, seq_len: int, num_ranks: int, block_size: int,
                          **options) -> dict:
  """Compiled per-device costs of one attention layer's forward + backward.

  `options` are those of `attention_layer_program`; nothing is allocated on the devices (the
  program is compiled from abstract shapes). Returns:
    collective_bytes: {kind: bytes} per device per step (hlo_stats conventions: operand bytes,
                      while-loop trip counts applied)
    total_collective_bytes, temp_bytes, argument_bytes: ints, per device
    memory: all of hlo_stats.memory_stats
    flops: XLA's estimate (counts a loop body once: compare only like with like)
    rows_per_rank: rows each rank holds in the layout (padding included)
  """
  grad_fn, shapes, _ = _layer(strategy, seq_len, num_ranks, block_size, **options)
  compiled = grad_fn.lower(*shapes).compile()
  by_kind = hlo_stats.collective_bytes(compiled)
  memory = hlo_stats.memory_stats(compiled)
  return dict(collective_bytes=by_kind, total_collective_bytes=sum(by_kind.values()),
              temp_bytes=memory["temp_size_in_bytes"],
              argument_bytes=memory["argument_size_in_bytes"], memory=memory,
              flops=hlo_stats.flops(compiled), rows_per_rank=shapes[0].shape[1] // num_ranks)
