"""`recur`: how a layout's rows run through a recurrent (Gated DeltaNet) layer (docs/gdn.md).

`recur(cell, pre_BRC, g_BRH, beta_BRH, meta) -> o_BRHV` is the model's hook for its sequence
mixer (models/gdn.py), as `attend` is for attention. BDLM semantics (the seed's): the clean
stream runs one causal pass; corrupted block b starts from the clean stream's state after
position bB - 1 (zeros for b = 0), with the clean stream's last `halo` pre-conv rows before
bB as its conv context, and is causal inside (the block's bidirectionality comes from the
attention layers). Equivalently: block b's output is the layer run on
concat(clean[:bB], noisy block b), last B rows.

Packed documents (segment ids, `meta.seg`): every document runs as if alone. A row whose
document id differs from its position's predecessor's starts a document: the state restarts
there (the affine map's zero transition, M = 0, so no chain hop carries anything across it) and
no conv tap reads before it, in the clean stream and in every corrupted block (a block that
a document starts inside restarts at that row; one that a document starts at, at its first).
The document ids travel with the rows they label: each segment's tail rows' ids with the
conv tails, a fetched copy's with its rows.

Under any layout the same static program runs (`StreamProgram`, built once from the plan):

1. Each rank cuts its clean slot into *segments* of consecutive positions. A segment's effect
   on the state is affine, S_out = M S_in + N (`Cell.transfer`), so each rank computes its
   segments' (M, N) at once, in parallel with every other rank.
2. A chain over the segments in position order gives each its entry state: the holder of the
   segment before applies (M, N) to that segment's entry and sends the one state it gets,
   [Hv, K, V], to the next segment's holder (a one-pair `ppermute`). 2P - 1 hops of one state
   each on a zigzag: each rank sends about two states a layer, against (2P - 1) pairs (M, N)
   that an all-gather would deliver to every rank (docs/gdn.md weighs the choices).
3. The conv's `halo` rows before each segment come from one all-gather of every segment's
   last rows (a few rows a rank), their document ids from one beside it.
4. Each rank reruns its segments from their entry states in one `lax.scan` over steps of B
   rows, and runs each of its corrupted blocks beside the step that starts at the block's
   position: same state, same conv rows. Where a rank's blocks are not on its own clean rows
   (`cp_*`'s zigzag of the whole stream, `csbp_*` with a block count that does not divide
   2P) it first fetches a copy of the clean segment that holds them (rows and entry state)
   and runs that beside them; its outputs are discarded.

Nothing materialises one state per block: the scan carries one, and its backward recomputes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import OBJECTIVES, get_objective
from bdlm_jax.parallel.layout import PAD, LayoutPlan
from bdlm_jax.parallel.mesh import BATCH_AXES
from bdlm_jax.parallel.registry import plan_for

# The name scope of the recurrence's collectives (the step report counts them apart).
RECURRENCE_SCOPE = "seq_recurrence"


def check_config(cfg: Config) -> None:
  """A model with Gated DeltaNet layers trains with an objective whose rows are `[x_t ; x_0]`
  in blocks of B (or the clean stream alone): not a drafter's draft blocks, nor canvases
  numbered by position; and on a layout `StreamProgram` can run."""
  if "gdn" not in cfg.model.layer_period:
    return
  if not runs_gdn(get_objective(cfg.objective.name)):
    raise ConfigError(f"objective.name={cfg.objective.name!r} cannot train Gated DeltaNet "
                      f"layers (model.layer_pattern={cfg.model.layer_pattern!r}) yet; use one "
                      f"of {[name for name, o in OBJECTIVES.items() if runs_gdn(o)]}")
  if cfg.data.format == "chat" and cfg.data.supervise == "assistant":
    raise ConfigError("data.supervise='assistant' pads between a conversation's turns, and "
                      "Gated DeltaNet layers restart their state after padding: set "
                      "data.supervise='last' (or 'all')")
  stream_program(plan_for(cfg), cfg.model.gdn_conv - 1)


def runs_gdn(objective) -> bool:
  return objective.BLOCK_IDS == "index" and not objective.DRAFTER


def causal(cell, pre_BRC, g_BRH, beta_BRH, meta):
  """Every row, in order, is one causal stream from zeros (ar_logits; a canvas after its
  prompt, which is the concat reference itself)."""
  del meta
  return cell(pre_BRC, None, g_BRH, beta_BRH, None)[0]


@dataclasses.dataclass(frozen=True, eq=False)
class StreamProgram:
  """Static tables of how a layout's rows run as one clean stream and its corrupted blocks.

  Per rank there are W work segments: its `own` clean segments, then copies fetched from
  other ranks. Work segment w is laid out as `halo + steps * unit` rows: the conv's left
  context, then `steps` scan steps of `unit` rows, step k starting at a multiple of the
  block size (a front pad of rows that leave the state alone aligns it).
  """
  halo: int  # the conv's left context rows; at least 1 (the document id before a segment)
  unit: int
  steps: int
  own: int
  seg_offsets: tuple[int, ...]  # each own segment's first row in the clean slot
  seg_len: int  # the longest segment's rows (a fetched copy's width)
  # int [P, W, halo + steps * unit]: the row of the rank's source buffer each row of a work
  # segment reads ([clean slot | fetched copies | all ranks' segment tails | a zero row])
  src: np.ndarray
  real: np.ndarray  # bool [P, W, halo + steps * unit]: a real clean row (else g = beta = 0)
  out: np.ndarray  # int [P, W, steps * unit]: clean slot row of each output, -1: discarded
  pair: np.ndarray  # int [P, W, steps]: noisy slot block run beside each step, -1: none
  tails: np.ndarray  # int [P, own, halo]: clean slot rows each segment shares as its tail
  chain: tuple[tuple[int, int, int, int], ...]  # (rank, seg, from rank, from seg), in order
  transfer_segs: tuple[int, ...]  # own segments whose (M, N) some chain step reads
  fetch: np.ndarray  # int [P, fetched, 2]: (rank, own segment) each copy comes from; -1: none
  shares_tails: bool  # whether any segment's conv reads rows before it

  def fetch_permutes(self) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """[(copy e, own segment g, ppermute pairs)]: how the ranks' copies e of segment g travel,
    one source a `ppermute` (two ranks may copy one segment)."""
    out = []
    for e in range(self.fetch.shape[1]):
      for g in range(self.own):
        pairs = [(int(q), r) for r, (q, h) in enumerate(self.fetch[:, e]) if h == g]
        out += [(e, g, perm) for perm in _one_source_each(pairs)]
    return out


def stream_program(plan: LayoutPlan, halo: int) -> StreamProgram:
  """The `StreamProgram` of `plan` (conv context `halo` rows, at least 1: a segment's first
  row needs the document id of the row before it); a ConfigError names why a layout cannot
  run one."""
  return _cached_program(plan, max(halo, 1))


@functools.lru_cache(maxsize=64)
def _cached_program(plan: LayoutPlan, halo: int) -> StreamProgram:
  nr, n_noisy = plan.num_ranks, plan.n_noisy
  refuse = lambda why: ConfigError(
      f"parallel.strategy={plan.strategy!r} cannot run Gated DeltaNet layers with "
      f"data.seq_len={plan.seq_len}, objective.block_size={plan.block_size}, "
      f"parallel.seq={nr}: {why}")
  if plan.draft_blocks:
    raise refuse("a drafter's draft blocks have no recurrent semantics")
  slot = plan.rows[:, n_noisy:].astype(np.int64)
  pos = np.where(slot == PAD, -1, slot - plan.noisy_len)
  width = slot.shape[1]

  # Segments: cut every rank's slot where any rank's run of positions breaks.
  cuts = {0}
  for p in pos:
    for i in range(1, width):
      if p[i] >= 0 and p[i] != p[i - 1] + 1:
        cuts.add(i)
  offsets = sorted(cuts)
  bounds = list(zip(offsets, offsets[1:] + [width]))
  start = np.zeros((nr, len(bounds)), np.int64)
  length = np.zeros((nr, len(bounds)), np.int64)
  for r in range(nr):
    for g, (a, b) in enumerate(bounds):
      p = pos[r, a:b]
      n = int((p >= 0).sum())
      if n and not ((p[:n] >= 0).all() and (np.diff(p[:n]) == 1).all()):
        raise refuse(f"rank {r}'s clean rows {a}..{b - 1} are not one run of positions")
      start[r, g], length[r, g] = (p[0], n) if n else (0, 0)
  ends = {(int(start[r, g] + length[r, g])): (r, g)
          for r in range(nr) for g in range(len(bounds)) if length[r, g]}

  # The chain: each segment not at 0 takes its entry from the segment that ends before it.
  chain = []
  for r, g in sorted(np.argwhere(start > 0).tolist(), key=lambda rg: start[rg[0], rg[1]]):
    if int(start[r, g]) not in ends:
      raise refuse(f"no rank's clean segment ends at position {start[r, g] - 1}")
    chain.append((r, g, *ends[int(start[r, g])]))
  # Tails: each segment's last `halo` rows, which later segments' conv reads.
  tails = np.full((nr, len(bounds), halo), -1, np.int64)
  tail_of = {}
  for r in range(nr):
    for g, (a, _) in enumerate(bounds):
      for i in range(halo):
        j = int(length[r, g]) - halo + i
        if j >= 0:
          tails[r, g, i] = a + j
          tail_of.setdefault(int(start[r, g]) + j, (r * len(bounds) + g) * halo + i)

  # Corrupted blocks: beside a step of an own segment, else of a fetched copy.
  unit = plan.block_size if n_noisy else max(1, int(length.max()))
  covers = lambda r, g, b: (start[r, g] <= b * unit <= start[r, g] + length[r, g]
                            and (length[r, g] or b == 0))
  fetches = [[] for _ in range(nr)]
  pairs = [[] for _ in range(nr)]  # (work segment as (rank, seg), block, noisy slot block)
  for r in range(nr):
    for i in range(n_noisy // unit if n_noisy else 0):
      rows = plan.rows[r, i * unit:(i + 1) * unit]
      if rows[0] == PAD:
        continue
      b = int(rows[0]) // unit
      if not (rows == b * unit + np.arange(unit)).all():
        raise refuse(f"rank {r}'s corrupted rows {i * unit}.. are not one whole block")
      mine = [g for g in range(len(bounds)) if covers(r, g, b)]
      if mine:
        pairs[r].append(((r, mine[0]), b, i))
        continue
      theirs = [(q, g) for q in range(nr) for g in range(len(bounds)) if covers(q, g, b)]
      if not theirs:
        raise refuse(f"no clean segment reaches block {b}'s start")
      if theirs[0] not in fetches[r]:
        fetches[r].append(theirs[0])
      pairs[r].append((theirs[0], b, i))
  n_fetch = max(len(f) for f in fetches)
  fetch = np.full((nr, n_fetch, 2), -1, np.int64)
  for r, f in enumerate(fetches):
    fetch[r, :len(f)] = np.reshape(f, (-1, 2))

  seg_len = max(b - a for a, b in bounds)
  work = [[(r, g) for g in range(len(bounds))] + fetches[r] for r in range(nr)]
  front = lambda q, g: int(start[q, g]) % unit if n_noisy else 0
  steps = max([-(-(front(q, g) + int(length[q, g])) // unit) for w in work for q, g in w]
              + [(b * unit - int(start[q, g]) + front(q, g)) // unit + 1
                 for p in pairs for (q, g), b, _ in p] + [1])
  n_rows = halo + steps * unit
  n_work = len(bounds) + n_fetch
  zero = width + n_fetch * seg_len + nr * len(bounds) * halo  # the zero row
  src = np.full((nr, n_work, n_rows), zero, np.int64)
  real = np.zeros((nr, n_work, n_rows), bool)
  out = np.full((nr, n_work, steps * unit), -1, np.int64)
  pair = np.full((nr, n_work, steps), -1, np.int64)
  for r in range(nr):
    for w, (q, g) in enumerate(work[r]):
      first = int(start[q, g]) - front(q, g) - halo  # the position of row 0
      for j in range(n_rows):
        p = first + j
        if start[q, g] <= p < start[q, g] + length[q, g]:
          i = p - int(start[q, g])
          src[r, w, j] = (bounds[g][0] + i if w < len(bounds)
                          else width + (w - len(bounds)) * seg_len + i)
          real[r, w, j] = True
          if w < len(bounds):
            out[r, w, j - halo] = bounds[g][0] + i
        elif 0 <= p < start[q, g] and p >= start[q, g] - halo:
          if p not in tail_of:
            raise refuse(f"position {p}, conv context of a segment, is not among any "
                         f"segment's last {halo} rows")
          src[r, w, j] = width + n_fetch * seg_len + tail_of[p]
    for (q, g), b, i in pairs[r]:
      w = work[r].index((q, g))
      pair[r, w, (b * unit - int(start[q, g]) + front(q, g)) // unit] = i
  return StreamProgram(
      halo=halo, unit=unit, steps=steps, own=len(bounds), seg_offsets=tuple(offsets),
      seg_len=seg_len, src=src, real=real, out=out, pair=pair, tails=tails,
      chain=tuple(chain), transfer_segs=tuple(sorted({c[3] for c in chain})), fetch=fetch,
      shares_tails=bool(((src >= width + n_fetch * seg_len) & (src < zero)).any()))


def make_recur(plan: LayoutPlan, mesh=None):
  """`recur` of `plan`'s layout (see the module docstring); `mesh` where `plan` splits rows
  over the `seq` axis."""
  if plan.draft_blocks:
    def refuse(*args):
      raise ConfigError(f"a drafter's layout ({plan.strategy!r}) cannot run Gated DeltaNet "
                        f"layers")
    return refuse

  def recur(cell, pre_BRC, g_BRH, beta_BRH, meta):
    # Positions come from the plan, documents from the rows' segment ids.
    program = stream_program(plan, cell.halo)
    body = functools.partial(_run_program, plan, program, cell, mesh is not None)
    seg_BR = meta.seg.astype(jnp.int32)
    if mesh is None:
      return body(cell.conv_CK, pre_BRC, g_BRH, beta_BRH, seg_BR)
    rows = lambda *rest: P(BATCH_AXES, "seq", *rest)
    # Unchecked: the zero states that start the chain and the transfer's [0 | I] are the same
    # on every rank until rows meet them (check_vma would want each cast to varying).
    with jax.named_scope(RECURRENCE_SCOPE):
      return jax.shard_map(body, mesh=mesh,
                           in_specs=(P(), rows(None), rows(None), rows(None), rows()),
                           out_specs=rows(None, None), check_vma=False)(
                               cell.conv_CK, pre_BRC, g_BRH, beta_BRH, seg_BR)

  return recur


def _run_program(plan: LayoutPlan, program: StreamProgram, cell, sharded: bool, conv_CK,
                 pre_BRC, g_BRH, beta_BRH, seg_BR):
  """One rank's part of `program` (all of it on one device): o [S, R, Hv, V] float32.
  `cell`'s conv kernel comes in as `conv_CK`, an argument of the shard_map; `seg` int32
  [S, R] are the rows' document ids."""
  cell = dataclasses.replace(cell, conv_CK=conv_CK)
  shape = cell.shape
  rank = jax.lax.axis_index("seq") if sharded else 0
  table = lambda x: jnp.asarray(x)[rank]
  s, n_noisy, halo, unit = pre_BRC.shape[0], plan.n_noisy, program.halo, program.unit
  _, hv, dk, dv = shape
  slot = lambda x: x[:, n_noisy:]
  own, n_fetch = program.own, program.fetch.shape[1]

  def seg_rows(x, g):  # own segment g's clean slot rows, padded to the widest segment
    a = program.seg_offsets[g]
    x = slot(x)[:, a:a + program.seg_len]
    return jnp.pad(x, [(0, 0), (0, program.seg_len - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

  def fetched(x_per_seg):
    """[S, fetched, ...]: each fetched copy's rows (or state), from its rank."""
    got = [0] * n_fetch
    for e, g, perm in program.fetch_permutes():
      got[e] = got[e] + jax.lax.ppermute(x_per_seg(g), "seq", perm)
    return jnp.stack(got, 1)

  # The source buffer: [clean slot | fetched copies | every rank's segment tails | zero row].
  def buffer(x, tails):
    parts = [slot(x)]
    if n_fetch:
      parts.append(fetched(lambda g: seg_rows(x, g)).reshape(s, -1, *x.shape[2:]))
    parts += [tails.reshape(s, -1, *x.shape[2:]), jnp.zeros((s, 1, *x.shape[2:]), x.dtype)]
    return jnp.concatenate(parts, axis=1)

  tails_n = plan.num_ranks * own * halo

  def gather_tails(x):  # [S, P * own * halo, ...]: every rank's segments' tail rows of x
    if not program.shares_tails:
      return jnp.zeros((s, tails_n, *x.shape[2:]), x.dtype)
    idx = table(program.tails).reshape(-1)
    mine = jnp.where((idx >= 0).reshape(1, -1, *[1] * (x.ndim - 2)),
                     jnp.take(slot(x), jnp.maximum(idx, 0), axis=1), 0)
    return jax.lax.all_gather(mine, "seq", axis=1, tiled=True) if sharded else mine

  src, real = table(program.src), table(program.real)
  x_pre = jnp.take(buffer(pre_BRC, gather_tails(pre_BRC)), src, axis=1)  # [S, W, halo+T*unit, C]
  zero_gb = lambda x: jnp.zeros((s, tails_n, *x.shape[2:]), x.dtype)
  x_g, x_beta = (jnp.where(real[..., None], jnp.take(buffer(x, zero_gb(x)), src, axis=1), 0)
                 for x in (g_BRH, beta_BRH))
  n_work = x_pre.shape[1]

  # Document starts: a row whose id differs from the row before's (both rows of the stream;
  # the zero row stands for positions outside it). The conv masks at every start; the state
  # restarts only at real rows (a front pad row that copies a tail must leave it alone).
  x_seg = jnp.take(buffer(seg_BR, gather_tails(seg_BR)), src, axis=1)  # [S, W, halo + T*unit]
  in_stream = src < slot(pre_BRC).shape[1] + n_fetch * program.seg_len + tails_n  # [W, rows]
  differs = (x_seg[..., 1:] != x_seg[..., :-1]) & in_stream[:, 1:] & in_stream[:, :-1]
  x_starts = jnp.concatenate([jnp.zeros_like(differs[..., :1]), differs], -1)

  steps = lambda x: jnp.moveaxis(x.reshape(*x.shape[:2], program.steps, unit, *x.shape[3:]),
                                 2, 0)  # [T, S, W', unit, ...]
  off = halo - cell.halo  # the program's context rows beyond the conv's (halo >= 1)

  def windows(x, first, n):
    """[T, S, W, n, ...]: rows first + k * unit .. of step k (one gather, not T slices: a
    1M-token stream has thousands of steps)."""
    idx = first + unit * np.arange(program.steps)[:, None] + np.arange(n)
    return jnp.moveaxis(jnp.take(x, idx, axis=2), 2, 0)

  left = windows(x_pre, off, cell.halo)  # each step's conv context
  starts = windows(x_starts, off, cell.halo + unit)  # [T, S, W, conv halo + unit]
  restarts = steps(x_starts[:, :, halo:] & real[:, halo:])
  xs = [steps(x[:, :, halo:]) for x in (x_pre, x_g, x_beta)] + [left, starts, restarts]

  # Entry states: (M, N) of the segments the chain reads, then the chain in position order.
  entry = [jnp.zeros((s, hv, dk, dv), jnp.float32) for _ in range(own)]
  if program.chain:
    segs = list(program.transfer_segs)
    flat = lambda x: x[:, :, segs].reshape(x.shape[0], s * len(segs), *x.shape[3:])

    @jax.checkpoint  # the backward recomputes a step from its carry: one [N | M] a step
    def compose(mn, xs):
      pre, g, beta, left, starts, restarts = xs
      return cell.transfer(pre, left, g, beta, mn, starts, restarts), None

    mn0 = jnp.broadcast_to(jnp.concatenate([jnp.zeros((dk, dv)), jnp.eye(dk)], -1),
                           (s * len(segs), hv, dk, dv + dk))
    mn, _ = jax.lax.scan(compose, mn0, [flat(x) for x in xs])
    mn = mn.reshape(s, len(segs), *mn.shape[1:])
    for r, g, q, h in program.chain:
      i = segs.index(h)
      out = jnp.einsum("shij,shjv->shiv", mn[:, i, ..., dv:], entry[h]) + mn[:, i, ..., :dv]
      if q != r:
        out = jax.lax.ppermute(out, "seq", [(q, r)])
      entry[g] = jnp.where(rank == r, out, entry[g])
  entries = jnp.stack(entry, 1)
  if n_fetch:
    entries = jnp.concatenate([entries, fetched(lambda g: entry[g])], axis=1)

  # Noisy blocks run beside the step that starts at their position.
  blocks = lambda x: jnp.pad(
      x[:, :n_noisy].reshape(s, n_noisy // unit, unit, *x.shape[2:]),
      [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 1))  # a zero block for `pair` = -1
  pair = table(program.pair)
  noisy = [jnp.moveaxis(jnp.take(blocks(x), jnp.where(pair >= 0, pair, n_noisy // unit),
                                 axis=1), 2, 0) for x in (pre_BRC, g_BRH, beta_BRH, seg_BR)]
  # A block's document starts: its rows' ids against the row before each (the clean row
  # before the block for its first); its conv context's starts are the clean stream's.
  n_seg = jnp.concatenate([windows(x_seg, halo - 1, 1), noisy[3]], -1)  # [T, S, W, 1 + unit]
  n_restarts = n_seg[..., 1:] != n_seg[..., :-1]
  n_restarts = n_restarts.at[..., 0].set(n_restarts[..., 0]
                                         & windows(in_stream[None], halo - 1, 1)[..., 0])
  n_starts = jnp.concatenate([starts[..., :cell.halo], n_restarts], -1)
  xs = xs[:3] + noisy[:3] + xs[3:] + [n_starts, n_restarts]

  @jax.checkpoint  # the backward recomputes a step from its carry: one state a step
  def step(state, xs):
    pre, g, beta, n_pre, n_g, n_beta, left, starts, restarts, n_starts, n_restarts = xs
    both = lambda c, n: jnp.concatenate([c, n]).reshape(2 * s * n_work, *c.shape[2:])
    state2 = jnp.concatenate([state, state]).reshape(2 * s * n_work, hv, dk, dv)
    o, last = cell(both(pre, n_pre), both(left, left), both(g, n_g), both(beta, n_beta),
                   state2, both(starts, n_starts), both(restarts, n_restarts))
    return last[:s * n_work].reshape(state.shape), o.reshape(2, s, n_work, *o.shape[1:])

  _, o = jax.lax.scan(step, entries, xs)  # [T, 2, S, W, unit, Hv, V]
  clean = jnp.moveaxis(o[:, 0], 0, 2).reshape(s, n_work * program.steps * unit, hv, dv)
  noisy_o = jnp.moveaxis(o[:, 1], 0, 2).reshape(s, n_work * program.steps, unit, hv, dv)
  n_clean = pre_BRC.shape[1] - n_noisy
  scatter = lambda idx, vals, n: jnp.zeros((s, n + 1, *vals.shape[2:]), vals.dtype).at[
      :, jnp.where(idx >= 0, idx, n)].add(vals)[:, :n]
  clean_o = scatter(table(program.out).reshape(-1), clean, n_clean)
  if not n_noisy:
    return clean_o
  noisy_o = scatter(pair.reshape(-1), noisy_o, n_noisy // unit)
  return jnp.concatenate([noisy_o.reshape(s, n_noisy, hv, dv), clean_o], axis=1)


def _one_source_each(perm):
  """`perm`'s (source, destination) pairs in groups with one pair a source (a `ppermute`)."""
  groups = []
  for pair in perm:
    group = next((g for g in groups if all(pair[0] != q for q, _ in g)), None)
    if group is None:
      groups.append(group := [])
    group.append(pair)
  return groups
