"""Where a mixture-of-experts layer runs: each device routes the rows it holds.

Under plain jit, GSPMD cannot partition the routing (a sort of every (token, expert) pair and
grouped matmuls over them): it would gather the whole batch's pairs onto every device and
route all of them there. So the layer runs under `shard_map`, in one of two layouts:

* `parallel.expert_axes` empty: every device holds every expert (the layer scan gathered the
  weights) and runs `models.moe.experts` on its own rows.
* expert parallelism: the devices along `parallel.expert_axes` form a group of G that splits
  the E experts, E/G each, in order. A device sorts its (token, expert) pairs by expert, which
  also groups them by the device holding their expert, and sends each kept pair's row there;
  that device runs its experts' grouped matmuls on every row it received and sends the outputs
  back. The message sizes come from the group's per-expert pair counts (one small all-gather),
  so every device knows the whole exchange: `jax.lax.ragged_all_to_all` moves exactly the rows
  needed. The `all_gather` dispatch (what runs on CPU) gathers the group's tokens and routing
  instead, and returns each device's weighted expert outputs with one `psum_scatter`.
  Capacity (`model.moe_drop_tokens`) is counted over the group's tokens.

Dropless, a device routes its rows in `model.row_chunks` chunks one after the other (each
rematerialised), each chunk's pairs exchanged on their own: the receive buffer, sized for
every pair of the group's chunk at one device, shrinks by the chunk count, and the result is
the same, since every pair is routed whichever chunk it travels in.

Router statistics are sums over rows, so they are psummed over the row axes either way.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.models import moe
from bdlm_jax.models.transformer import in_parts
from bdlm_jax.parallel.mesh import BATCH_AXES

ROW_AXES = (*BATCH_AXES, "seq")


def check_config(cfg: Config) -> None:
  """Expert parallelism splits a model's experts over mesh axes: they must exist and divide."""
  m, p = cfg.model, cfg.parallel
  if not p.expert_axis_names:
    return
  if not m.moe_experts:
    raise ConfigError(f"parallel.expert_axes={p.expert_axes!r} splits experts, but "
                      f"model.moe_experts=0 (dense MLPs)")
  ways = math.prod(getattr(p, a) for a in p.expert_axis_names)
  if m.moe_experts % ways:
    raise ConfigError(f"model.moe_experts={m.moe_experts} does not divide over "
                      f"parallel.expert_axes={p.expert_axes!r} ({ways} devices)")


def check_dispatch_runs_here(cfg: Config, platform: str | None = None) -> None:
  """Refuses, before any data or checkpoint is touched, a dispatch that `platform` (default:
  this process's backend; a compile-only target names its own) cannot run."""
  if (cfg.parallel.expert_axis_names and cfg.parallel.moe_dispatch == "ragged_all_to_all"
      and (platform or jax.default_backend()) == "cpu"):
    raise ConfigError("parallel.moe_dispatch=ragged_all_to_all cannot run on CPU (XLA:CPU has "
                      "no ragged-all-to-all); set parallel.moe_dispatch=all_gather")


def dispatch_parts(m: ModelConfig) -> int:
  """How many chunks of its rows a device routes one after the other: `model.row_chunks`
  when dropless (every pair is routed whatever chunk it is in, so chunks change nothing but
  the buffers: a device may receive every pair of its group's chunk, G x rows x k / chunks
  rows), 1 with a capacity (counted over the rows routed together: all of them)."""
  return 1 if m.moe_drop_tokens else m.row_chunks


def expert_dispatch(cfg: Config, mesh):
  """The `dispatch` hook of `models.moe.MoE` for row-sharded activations on `mesh` (None on
  one device, where `experts` runs as it is, and for a model without experts)."""
  if mesh is None or mesh.size == 1 or not cfg.model.moe_experts:
    return None
  axes = cfg.parallel.expert_axis_names
  if axes:
    body = functools.partial(_expert_parallel, cfg.model, axes, cfg.parallel.moe_dispatch)
    weight_specs = (P(), P(axes), P(axes), P(axes))  # router, gate, up, down
  else:
    body, weight_specs = functools.partial(moe.experts, cfg.model), (P(),) * 4
  row_spec = P(BATCH_AXES, "seq", None)
  parts = dispatch_parts(cfg.model)

  def varying(w, spec):  # over the mesh axes `spec` does not split w over
    split = {a for s in spec if s for a in ((s,) if isinstance(s, str) else s)}
    rest = tuple(a for a in mesh.axis_names if a not in split)
    return jax.tree.map(lambda a: jax.lax.pcast(a, rest, to="varying"), w) if rest else w

  def local(x_BRD, row_weight_BR, weights):
    # Varying over every mesh axis from here on, so that each weight's gradient is summed
    # over the devices once, here, and not once per chunk inside the loop (see loss.py).
    weights = tuple(map(varying, weights, weight_specs))
    out_BRD, stats = in_parts(lambda w, x, rw: body(x, rw, w), parts, weights, x_BRD,
                              row_weight_BR)
    return out_BRD, jax.lax.psum(stats, ROW_AXES)

  def dispatch(x_BRD, row_weight_BR, weights):
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(row_spec, P(BATCH_AXES, "seq"), weight_specs),
                         out_specs=(row_spec, P()))(x_BRD, row_weight_BR, weights)

  return dispatch


class Exchange(NamedTuple):
  """Who sends whom how many rows, seen from device `me` of a group of G: `sent[i, j]` kept
  pairs go from member i to member j; a sender's rows for member j are contiguous in its send
  buffer, and a receiver stores its senders' rows in sender order."""

  sent: jax.Array  # [G, G] int32
  me: jax.Array  # [] int32

  @property
  def send_offsets(self):  # where my rows for each member start in my send buffer
    return moe.exclusive_cumsum(self.sent[self.me])

  @property
  def recv_offsets(self):  # where each member's rows start in my receive buffer
    return moe.exclusive_cumsum(self.sent[:, self.me])

  @property
  def offsets_at_receivers(self):  # where my rows land in each member's receive buffer
    return moe.exclusive_cumsum(self.sent, 0)[self.me]

  @property
  def offsets_at_senders(self):  # where each member's rows for me sit in its send buffer
    return moe.exclusive_cumsum(self.sent, 1)[:, self.me]


def _expert_parallel(m: ModelConfig, axes, how, x_BRD, row_weight_BR, weights):
  """`models.moe.experts` with this device's experts only (gate/up/down hold E/G of them):
  rows travel to their experts' devices and back."""
  router, gate_LDF, up_LDF, down_LFD = weights
  b, r, d = x_BRD.shape
  k, num_local = m.moe_top_k, gate_LDF.shape[0]
  group = m.moe_experts // num_local
  x_TD, weight_TK, expert_TK, logits_TE = moe.route(m, x_BRD.reshape(b * r, d), router)
  order_P, expert_P, sizes_E = moe.sort_pairs(expert_TK, m.moe_experts)
  cap = moe.capacity(m, group * b * r)
  kept_GGL = moe.kept_counts(jax.lax.all_gather(sizes_E, axes), cap).reshape(
      group, group, num_local)  # [sender, receiver, receiver's expert]
  me = jax.lax.axis_index(axes)
  keep_P = moe.keep_mask(expert_P, sizes_E, kept_GGL[me].reshape(-1))
  keep_TK = moe.unsort(keep_P, order_P, k)
  # My experts' rows, in expert order: every member may send me all its pairs; with a
  # capacity my experts take at most cap each.
  slots = group * order_P.shape[0] if cap is None else min(group * order_P.shape[0],
                                                          num_local * cap)
  sizes_L = kept_GGL[:, me].sum(0)
  mlp = lambda x_ND: moe.expert_mlp(m, x_ND, sizes_L, gate_LDF, up_LDF, down_LFD)
  if how == "ragged_all_to_all":
    y_PD = _ragged_exchange(x_TD[order_P // k], keep_P, Exchange(kept_GGL.sum(-1), me),
                            kept_GGL[:, me], slots, mlp, axes)
    out_TD = moe.combine(y_PD, order_P, weight_TK)
  else:
    out_TD = _gathered_tokens(x_TD, weight_TK, expert_TK, keep_TK, me * num_local, num_local,
                              slots, mlp, axes)
  return out_TD.reshape(b, r, d), moe.router_stats(row_weight_BR, logits_TE, expert_TK, keep_TK)


def _ragged_exchange(x_PD, keep_P, ex: Exchange, mine_GL, slots: int, mlp, axes):
  """[P, D] outputs of the expert-sorted pairs (0 where dropped): the kept rows, compacted
  (in expert order they are grouped by receiver), go to their experts' devices and back in
  two `ragged_all_to_all`s of exactly the rows needed."""
  pairs, d = x_PD.shape
  slot_P = jnp.where(keep_P, jnp.cumsum(keep_P) - 1, pairs)
  send_PD = jnp.zeros((pairs, d), x_PD.dtype).at[slot_P].set(x_PD, mode="drop")
  recv_ND = jax.lax.ragged_all_to_all(
      send_PD, jnp.zeros((slots, d), x_PD.dtype), ex.send_offsets, ex.sent[ex.me],
      ex.offsets_at_receivers, ex.sent[:, ex.me], axis_name=axes)
  # Received: sender by sender, each sender's rows by my local expert; group them by expert.
  group, num_local = mine_GL.shape
  expert_N = jnp.repeat(jnp.tile(jnp.arange(num_local), group), mine_GL.reshape(-1),
                        total_repeat_length=slots)
  expert_N = jnp.where(jnp.arange(slots) < mine_GL.sum(), expert_N, num_local)
  order_N = jnp.argsort(expert_N, stable=True)
  y_ND = mlp(recv_ND[order_N])
  y_ND = jnp.zeros_like(y_ND).at[order_N].set(y_ND)
  back_PD = jax.lax.ragged_all_to_all(
      y_ND, jnp.zeros((pairs, d), y_ND.dtype), ex.recv_offsets, ex.sent[:, ex.me],
      ex.offsets_at_senders, ex.sent[ex.me], axis_name=axes)
  return jnp.take(back_PD, slot_P, axis=0, mode="fill", fill_value=0)


def _gathered_tokens(x_TD, weight_TK, expert_TK, keep_TK, first: int, num_local: int,
                     slots: int, mlp, axes):
  """[T, D] outputs of my tokens: every member's tokens and routing are all-gathered, each
  device runs its experts on the kept pairs that picked them and weighs the outputs, and one
  `psum_scatter` sums each token's k outputs back onto its own device. Moves tokens, not
  (token, expert) pairs: k times fewer rows than gathering the pairs."""
  t, d = x_TD.shape
  k = expert_TK.shape[1]
  x_ND = jax.lax.all_gather(x_TD, axes).reshape(-1, d)
  expert_Q, weight_Q, keep_Q = (jax.lax.all_gather(a, axes).reshape(-1)
                                for a in (expert_TK, weight_TK, keep_TK))
  local_Q = expert_Q - first
  mine_Q = keep_Q & (local_Q >= 0) & (local_Q < num_local)
  order_N = jnp.argsort(jnp.where(mine_Q, local_Q, num_local), stable=True)[:slots]
  token_N = order_N // k
  y_ND = mlp(x_ND[token_N]) * weight_Q[order_N, None].astype(x_ND.dtype)
  out_ND = jnp.zeros_like(x_ND).at[token_N].add(y_ND)
  return jax.lax.psum_scatter(out_ND.reshape(-1, t, d), axes, scatter_dimension=0)
