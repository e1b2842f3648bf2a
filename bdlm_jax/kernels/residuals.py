"""The attention core's outputs that a remat policy keeps for the backward, by name.

Every attention `custom_vjp` (xla, pallas, the ring, the all-gather) names its output and
LSE inside its forward rule, where they are also its residuals: a `jax.checkpoint` policy
that saves these names then keeps them and recomputes the cheap rest (projections) without
re-running the attention or its collectives (DESIGN.md section 9).
"""

from jax.ad_checkpoint import checkpoint_name

OUT, LSE = "attention_out", "attention_lse"
NAMES = (OUT, LSE)


def keep(out, lse):
  """(out, lse), tagged so that `models.transformer.remat_policy` saves them."""
  return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)
