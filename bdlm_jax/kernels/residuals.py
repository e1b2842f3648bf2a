"""The attention core's outputs that a remat policy keeps for the backward, by name.

Every attention `custom_vjp` (xla, pallas, the ring, the all-gather) names its output and
LSE inside its forward rule, where they are also its residuals: a `jax.checkpoint` policy
that saves these names then keeps them and recomputes the cheap rest (projections) without
re-running the attention or its collectives (docs/memory.md). A local layer's windowed
exchange names the K/V rows it received, for the same reason.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

OUT, LSE = "attention_out", "attention_lse"
EXCHANGED = "attention_exchanged_kv"  # K/V rows a local layer's windowed exchange received
LAYER_INPUT = "layer_input"  # what a layer reads: the scan carry
STEP_INPUT = "scan_step_input"  # what a step of the layer scan reads (remat offload_period)
SAVED = (LAYER_INPUT, OUT, LSE, EXCHANGED)  # all a remat'd layer keeps for its backward


def keep(out, lse):
  """(out, lse), tagged so that `models.transformer.remat_policy` saves them."""
  return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)


def keep_input(x, offloaded: bool):
  """The layer input `x` (a pytree), tagged so that remat can put it in host memory: as the
  remat'd function's argument it is kept anyway, but only a named array can be offloaded.
  `offloaded`: the layer's remat policy does put it there."""
  return jax.tree.map(lambda a: _named(a, LAYER_INPUT, offloaded), x)


def keep_exchanged(rows):
  """`rows` (a pytree), tagged so that remat keeps them rather than exchanging them again."""
  return jax.tree.map(lambda x: checkpoint_name(x, EXCHANGED), rows)


def keep_step_input(x, offloaded: bool):
  """The layer scan step's input `x` (a pytree), tagged apart from its first layer's input:
  remat `offload_period` puts it in host memory (`offloaded`) and keeps the layers' inputs
  on the device."""
  return jax.tree.map(lambda a: _named(a, STEP_INPUT, offloaded), x)


# XLA:TPU (libtpu 0.0.42.1) aborts compiling a copy to host memory of an array whose bytes are
# a multiple of 4 GiB ("Check failed: index_space_.start <= index_space_.limit" in its strided
# DMA loop; 4 GiB - 64 KiB and 4 GiB + 64 MiB compile). Llama-3-8B's layer input on 4 chips at
# 1M is exactly 4 GiB a chip.
_DMA_WRAP = 1 << 32


def _named(a, name, offloaded: bool):
  """`a` named `name`; where it goes to host memory and its size is a multiple of 4 GiB (per
  device it is only if it is globally), in two halves of its last axis, each then offloaded
  on its own. The backward joins the halves again, one transient copy of `a`."""
  if not offloaded or a.nbytes % _DMA_WRAP or a.shape[-1] % 2:
    return checkpoint_name(a, name)
  halves = jnp.split(a, 2, axis=-1)
  return jnp.concatenate([checkpoint_name(h, name) for h in halves], axis=-1)
