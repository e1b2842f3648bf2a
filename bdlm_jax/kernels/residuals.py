"""The attention core's outputs that a remat policy keeps for the backward, by name.

Every attention `custom_vjp` (xla, pallas, the ring, the all-gather) names its output and
LSE inside its forward rule, where they are also its residuals: a `jax.checkpoint` policy
that saves these names then keeps them and recomputes the cheap rest (projections) without
re-running the attention or its collectives (docs/memory.md). A local layer's windowed
exchange names the K/V rows it received, for the same reason.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

OUT, LSE = "attention_out", "attention_lse"
EXCHANGED = "attention_exchanged_kv"  # K/V rows a local layer's windowed exchange received
LAYER_INPUT = "layer_input"  # what a layer reads: the scan carry
SAVED = (LAYER_INPUT, OUT, LSE, EXCHANGED)  # all a remat'd layer keeps for its backward


def keep(out, lse):
  """(out, lse), tagged so that `models.transformer.remat_policy` saves them."""
  return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)


def keep_input(x):
  """The layer input `x` (a pytree), tagged so that remat can put it in host memory: as the
  remat'd function's argument it is kept anyway, but only a named array can be offloaded."""
  return jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), x)


def keep_exchanged(rows):
  """`rows` (a pytree), tagged so that remat keeps them rather than exchanging them again."""
  return jax.tree.map(lambda x: checkpoint_name(x, EXCHANGED), rows)
