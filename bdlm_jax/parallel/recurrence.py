"""`recur`: how a layout's rows run through a recurrent (Gated DeltaNet) layer (docs/gdn.md).

`recur(cell, pre_BRC, g_BRH, beta_BRH, meta) -> o_BRHV` is the model's hook for its sequence
mixer (models/gdn.py), as `attend` is for attention. BDLM semantics (the seed's): the clean
stream runs one causal pass; corrupted block b starts from the clean stream's state after
position bB - 1 (zeros for b = 0), with the clean stream's last kernel - 1 pre-conv rows
before bB as its conv context, and is causal inside (the block's bidirectionality comes from
the attention layers). Equivalently: block b's output is the layer run on
concat(clean[:bB], noisy block b), last B rows.

Only the one-device layout runs it so far; a strategy that splits sequences over `seq`
refuses GDN layers (`check_config`) until the cross-device state scan exists.
"""

import jax
import jax.numpy as jnp

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import OBJECTIVES, get_objective
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.registry import SINGLE_DEVICE


def check_config(cfg: Config) -> None:
  """A model with Gated DeltaNet layers runs on one seq rank, with an objective whose rows
  are `[x_t ; x_0]` in blocks of B (or the clean stream alone): not a drafter's draft blocks,
  nor canvases numbered by position."""
  if "gdn" not in cfg.model.layer_period:
    return
  if cfg.parallel.strategy != SINGLE_DEVICE:
    raise ConfigError(f"parallel.strategy={cfg.parallel.strategy!r} cannot run Gated DeltaNet "
                      f"layers (model.layer_pattern={cfg.model.layer_pattern!r}) yet: their "
                      f"cross-device state scan is not implemented; use "
                      f"parallel.strategy={SINGLE_DEVICE!r}")
  if not runs_gdn(get_objective(cfg.objective.name)):
    raise ConfigError(f"objective.name={cfg.objective.name!r} cannot train Gated DeltaNet "
                      f"layers (model.layer_pattern={cfg.model.layer_pattern!r}) yet; use one "
                      f"of {[name for name, o in OBJECTIVES.items() if runs_gdn(o)]}")


def runs_gdn(objective) -> bool:
  return objective.BLOCK_IDS == "index" and not objective.DRAFTER


def causal(cell, pre_BRC, g_BRH, beta_BRH, meta):
  """Every row, in order, is one causal stream from zeros (ar_logits; a canvas after its
  prompt, which is the concat reference itself)."""
  del meta
  return cell(pre_BRC, None, g_BRH, beta_BRH, None)[0]


def make_recur(plan: LayoutPlan):
  """`recur` of `plan`'s layout (see the module docstring)."""
  if plan.strategy != SINGLE_DEVICE or plan.draft_blocks:
    def refuse(*args):
      raise ConfigError(f"layout {plan.strategy!r} cannot run Gated DeltaNet layers yet")
    return refuse
  if not plan.n_noisy:  # the clean stream alone (ar)
    return causal
  seq_len, block = plan.seq_len, plan.block_size

  def recur(cell, pre_BRC, g_BRH, beta_BRH, meta):
    """Rows [noisy 0..L-1 | clean 0..L-1]: one scan over blocks carries the clean state;
    step b runs clean block b and noisy block b side by side from it."""
    del meta
    s = pre_BRC.shape[0]
    n = seq_len // block
    halo = cell.keywords["conv_CK"].shape[1] - 1
    # Block b's conv context: clean pre-conv rows bB - halo .. bB - 1 (zeros before 0).
    clean = jnp.pad(pre_BRC[:, seq_len:], [(0, 0), (halo, 0), (0, 0)])
    left_NSJC = jnp.moveaxis(clean[:, jnp.arange(n)[:, None] * block + jnp.arange(halo)], 1, 0)
    per_block = lambda x: jnp.moveaxis(x.reshape(s, 2 * n, block, *x.shape[2:]), 1, 0)
    both = lambda x: jnp.stack([x[n:], x[:n]], 1)  # [N, 2 (clean, noisy), S, B, ...]
    xs = [both(per_block(x)) for x in (pre_BRC, g_BRH, beta_BRH)]

    def step(state, xs):
      pre, g, beta, left = xs
      flat = lambda x: x.reshape(2 * s, *x.shape[2:])
      o, out = cell(flat(pre), jnp.concatenate([left, left]), flat(g), flat(beta),
                    jnp.concatenate([state, state]))
      return out[:s], o.reshape(2, s, *o.shape[1:])

    _, hv, dk, dv = cell.keywords["shape"]
    zeros = jnp.zeros((s, hv, dk, dv), jnp.float32)
    _, o = jax.lax.scan(step, zeros, xs + [left_NSJC])  # [N, 2, S, B, H, V]
    noisy, clean = (jnp.moveaxis(o[:, i], 0, 1).reshape(s, seq_len, *o.shape[4:])
                    for i in (1, 0))
    return jnp.concatenate([noisy, clean], axis=1)

  return recur
