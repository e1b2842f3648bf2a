"""Static layout plans: which logical rows of `[x_t ; x_0]` each rank of the `seq` axis holds.

A plan is pure data, computed once in NumPy from (L, B, P). Logical row r < L is the noisy
(corrupted) token at position r; row L + p is the clean token at position p. A drafter
objective (dflash) has A draft blocks of B rows as its noisy stream instead: rows r < A*B,
then the clean context A*B + p (`noisy_len`). Every rank
holds the same number of rows: first its *noisy slot* (`n_noisy` rows), then its *clean
slot*; -1 marks a padding row. `travel` says which local K/V must visit other ranks:

  none   nothing travels (single device, or `bp`, which replicates the clean prefix)
  all    every local K/V row travels (`cp_*`: the whole stream is context-parallel)
  clean  only the clean slot travels (`csbp_*`: corrupted K/V never leave their rank;
         `cp_replicated_drafts`: every rank holds every draft block)

Each strategy of `registry.py` names one plan builder below,
`builder(name, L, B, P, noisy_stream, draft_blocks) -> LayoutPlan`; adding a strategy means
adding a builder (or reusing one) and a record, and the model and the objective never change.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from bdlm_jax.errors import ConfigError

PAD = -1


@dataclasses.dataclass(frozen=True, eq=False)
class LayoutPlan:
  strategy: str
  seq_len: int
  block_size: int
  rows: np.ndarray  # int32 [P, rows_per_rank]: logical row index, PAD for padding
  n_noisy: int
  travel: str
  draft_blocks: int = 0  # A: the noisy stream is A draft blocks (dflash); 0: the sequence's own
  # int64 [A]: where a static cost places the sorted anchors (the cost model's anchor rule);
  # None: uniform anchors (`block_starts`)
  anchor_starts: np.ndarray | None = None

  @property
  def noisy_len(self) -> int:
    """Logical noisy rows; the clean row of position p is `noisy_len + p`."""
    return self.draft_blocks * self.block_size if self.draft_blocks else self.seq_len

  def block_starts(self) -> np.ndarray:
    """int64 [noisy blocks]: the clean context each noisy block sees, as its first position.

    A draft block's anchor depends on the data; here the j-th of A sorted anchors sits at its
    expected place, (j + 1) * L / (A + 1) (uniform anchors), so static costs can use it.
    """
    if self.anchor_starts is not None:
      return np.asarray(self.anchor_starts, np.int64)
    if self.draft_blocks:
      j = np.arange(self.draft_blocks)
      return np.round((j + 1) * self.seq_len / (self.draft_blocks + 1)).astype(np.int64)
    return np.arange(self.seq_len // self.block_size, dtype=np.int64) * self.block_size

  @property
  def num_ranks(self) -> int:
    return self.rows.shape[0]

  @property
  def rows_per_rank(self) -> int:
    return self.rows.shape[1]

  @property
  def n_stay(self) -> int:
    """Local rows before each rank's travelling part: the noisy slot when only clean K/V
    travel (csbp), none when everything does (cp)."""
    return self.n_noisy if self.travel == "clean" else 0

  def window_reach(self, window: int) -> np.ndarray:
    """bool [L]: the positions some draft block's window reaches, [start - (W-1), start)
    (slot 0's; a later slot's starts later): the context rows pruning keeps (one document)."""
    starts = self.block_starts()
    edges = np.zeros(self.seq_len + 1, np.int64)
    np.add.at(edges, np.maximum(starts - window + 1, 0), 1)
    np.add.at(edges, starts, -1)
    return np.cumsum(edges)[:self.seq_len] > 0

  def attention_work(self, window: int | None = None, keys: np.ndarray | None = None,
                     causal_drafts: bool = False) -> np.ndarray:
    """Allowed (query, key) pairs of each rank's queries (one document), on a global layer or
    a local one of window W: int64 [P] against every key of the stream (what each rank
    computes), or int64 [P, G] against each row group of `keys` (int [G, K] logical rows,
    PAD for none: e.g. each rank's travelling K/V, to split the work by whose K/V it reads).

    The mask of kernels/mask.py, counted by block and position: a noisy query of block b
    sees the noisy keys of its block and the clean keys before its block's start
    (`block_starts`: bB, or a draft block's anchor); a clean query of block b the clean keys
    before (b+1)B (none in a drafter's plan: its context rows are keys only). A window drops
    the clean keys before the block's start - (W-1) (a noisy query), slot j of a draft
    block's own position, anchor + j, - (W-1) (`models.drafter.windowed_drafts`), or
    p - (W-1) (a clean query at p). `causal_drafts`: a draft slot sees its block's slots up
    to its own, not all B (`drafter.sliding_causal`).
    """
    B, n, L = self.block_size, self.noisy_len, self.seq_len
    groups = np.arange(n + L)[None] if keys is None else np.asarray(keys)
    valid = self.rows != PAD
    noisy = valid & (self.rows < n)
    clean = valid & ~noisy & (self.draft_blocks == 0)
    pos = np.where(noisy, self.rows, self.rows - n)
    per_block = lambda rows, where, blocks: np.stack(
        [np.bincount(r[w] // B, minlength=blocks) for r, w in zip(rows, where)])
    q_noisy, q_clean = per_block(self.rows, noisy, n // B), per_block(pos, clean, L // B)
    k_noisy = per_block(groups, (groups != PAD) & (groups < n), n // B)
    k_clean = [np.sort(g[g >= n] - n) for g in groups]
    before = lambda x: np.stack([np.searchsorted(c, x) for c in k_clean])  # [G, *x.shape]
    starts = self.block_starts()
    pairs = (q_noisy @ (k_noisy + before(starts)).T
             + q_clean @ before(np.arange(1, L // B + 1) * B).T)
    q_row = np.where(noisy, self.rows, 0)
    if window is not None:
      slot = q_row % B if self.draft_blocks else 0
      lo = np.where(noisy, starts[q_row // B] + slot, pos) - (window - 1)
      pairs -= before(np.where(noisy | clean, np.maximum(lo, 0), 0)).sum(axis=-1).T
    if causal_drafts:  # the slots of its block after its own
      k_draft = [np.sort(g[(g != PAD) & (g < n)]) for g in groups]
      later = np.stack([np.searchsorted(k, (q_row // B + 1) * B) - np.searchsorted(
          k, q_row, side="right") for k in k_draft])  # [G, P, rows]
      pairs -= np.where(noisy, later, 0).sum(axis=-1).T
    return pairs[:, 0] if keys is None else pairs

  @functools.cached_property
  def first_copies(self) -> np.ndarray:
    """bool [P * rows_per_rank]: False on the later copies of a row that a layout repeats
    (`bp` replicates the clean prefix), so that a label there is counted and scored once.
    Computed once per plan, not per batch."""
    flat = self.rows.reshape(-1)
    first = np.zeros(flat.shape, bool)
    first[np.unique(flat, return_index=True)[1]] = True
    return first

  @functools.cached_property
  def counted_rows(self) -> np.ndarray:
    """bool [P * rows_per_rank]: the rows that statistics pooled over a step's rows (the MoE
    router's load-balancing and z losses) count: the same logical rows under every layout,
    each once. Not padding, not a later copy, and in a block-diffusion stream not the last
    block's clean rows: no noisy block reads them as context and no label sits there, so a
    layout may leave them out (`bp` does), and counting them where one holds them would make
    the statistics depend on the strategy. (A drafter's context rows all feed its target.)"""
    flat = self.rows.reshape(-1)
    block_diffusion = self.n_noisy > 0 and not self.draft_blocks
    reach = self.seq_len - self.block_size if block_diffusion else self.seq_len
    return self.first_copies & (flat != PAD) & (flat - self.noisy_len < reach)

  @functools.cached_property
  def context_rows(self) -> np.ndarray:
    """int32 [L]: where each position's clean row is among every rank's clean slot, laid end
    to end (its first copy where `bp` replicates it): how a row fetches another position's
    clean state."""
    clean = self.rows[:, self.n_noisy:].reshape(-1) - self.noisy_len
    out = np.zeros(self.seq_len, np.int32)
    first = np.unique(np.where(clean >= 0, clean, self.seq_len), return_index=True)
    keep = first[0] < self.seq_len
    out[first[0][keep]] = first[1][keep]
    return out

  def slot_rows(self, x_SR, slot: str):
    """The rows of every rank's noisy (or clean) slot of a layout-ordered array [S, R, ...]:
    [S, P * slot rows, ...]; all of them for `slot="all"`."""
    if slot == "all":
      return x_SR
    s = x_SR.shape[0]
    x = x_SR.reshape(s, self.num_ranks, self.rows_per_rank, *x_SR.shape[2:])
    x = x[:, :, :self.n_noisy] if slot == "noisy" else x[:, :, self.n_noisy:]
    return x.reshape(s, -1, *x_SR.shape[2:])

  def with_slot(self, x_SR, slot_rows, slot: str):
    """`x_SR` with the rows of every rank's noisy (or clean) slot replaced by `slot_rows`
    ([S, P * slot rows, ...], as `slot_rows` gives them)."""
    s, rest = x_SR.shape[0], x_SR.shape[2:]
    x = x_SR.reshape(s, self.num_ranks, self.rows_per_rank, *rest)
    new = slot_rows.reshape(s, self.num_ranks, -1, *rest)
    x = jnp.concatenate([new, x[:, :, self.n_noisy:]] if slot == "noisy" else
                        [x[:, :, :self.n_noisy], new], axis=2)
    return x.reshape(s, -1, *rest)

  def valid_rows(self) -> np.ndarray:
    """int64 [P]: non-padding rows held by each rank (what activation memory scales with)."""
    return (self.rows != PAD).sum(axis=1)


def zigzag(n_rows: int, num_ranks: int, offset: int = 0) -> np.ndarray:
  """[P, n_rows/P]: 2P equal chunks, rank r holds chunks r and 2P-1-r (dual-chunk balance)."""
  if n_rows % (2 * num_ranks):
    raise ConfigError(
        f"a zigzag split of {n_rows} rows over parallel.seq={num_ranks} ranks needs the row "
        f"count divisible by 2*seq={2 * num_ranks}; pick data.seq_len divisible by 2*parallel.seq")
  chunks = np.arange(n_rows).reshape(2 * num_ranks, -1) + offset
  return np.concatenate([chunks[:num_ranks], chunks[::-1][:num_ranks]], axis=1)


def _zigzag_halves(L: int, B: int, P: int) -> np.ndarray:
  """Each half of `[x_t ; x_0]` zigzagged on its own, in block-aligned chunks: rank r holds
  noisy chunks (r, 2P-1-r) and clean chunks (r, 2P-1-r).

  The whole-stream zigzag of `cp_*` balances each rank's total work but not each ring step
  (at a given step one rank's queries may see all of the visiting K/V and another's none);
  here, as with a causal mask, every rank has the same allowed pairs at every step.
  """
  if L % (2 * P * B):
    raise ConfigError(
        f"cp_ring_balanced cuts each half into 2*seq={2 * P} chunks of whole blocks: "
        f"data.seq_len={L} must be divisible by 2*parallel.seq*objective.block_size="
        f"{2 * P * B}")
  return np.concatenate([zigzag(L, P), zigzag(L, P, offset=L)], axis=1)


def assign_blocks(n_blocks: int, num_ranks: int) -> list[list[int]]:
  """Corrupted blocks per rank, balanced by attention work (block b costs b+1).

  When N is a multiple of 2P, dual-end pairs (i, N-1-i) all cost N+1 and are split
  contiguously, the same number per rank. Otherwise (P <= N < 2P, or pairs that do not
  divide evenly) blocks are placed greedily, largest first, on the least-loaded rank:
  contiguous pairs would give one rank a whole extra pair (up to 1.44x the mean work).
  """
  if n_blocks < num_ranks:
    raise ConfigError(
        f"{n_blocks} blocks cannot be split over parallel.seq={num_ranks} ranks: every rank "
        f"needs a corrupted block. Use a smaller objective.block_size (at most "
        f"data.seq_len/parallel.seq) or fewer seq ranks")
  if n_blocks % (2 * num_ranks) == 0:
    pairs = [[i, n_blocks - 1 - i] for i in range(n_blocks // 2)]
    groups = np.array_split(np.arange(len(pairs)), num_ranks)
    return [sorted(b for p in g for b in pairs[p]) for g in groups]
  owned: list[list[int]] = [[] for _ in range(num_ranks)]
  load = np.zeros(num_ranks, np.int64)
  for b in range(n_blocks - 1, -1, -1):
    r = int(np.argmin(load))
    owned[r].append(b)
    load[r] += b + 1
  return [sorted(o) for o in owned]


def _pad_rows(groups: list[np.ndarray]) -> np.ndarray:
  width = max(len(g) for g in groups)
  out = np.full((len(groups), width), PAD, np.int32)
  for r, g in enumerate(groups):
    out[r, :len(g)] = g
  return out


def _block_rows(blocks: list[int], block_size: int) -> np.ndarray:
  return np.concatenate([np.arange(b * block_size, (b + 1) * block_size) for b in blocks])


def single_device_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                       draft_blocks: int = 0) -> LayoutPlan:
  """Every row on one rank, in logical order: nothing travels."""
  if P != 1:
    raise ConfigError(f"strategy {name!r} runs on one seq rank; set parallel.seq=1")
  if draft_blocks:
    n = draft_blocks * B
    return LayoutPlan(name, L, B, np.arange(n + L, dtype=np.int32)[None], n, "none",
                      draft_blocks)
  rows = np.arange(2 * L) if noisy_stream else np.arange(L, 2 * L)
  return LayoutPlan(name, L, B, rows[None].astype(np.int32), L if noisy_stream else 0, "none")


def zigzag_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                draft_blocks: int = 0) -> LayoutPlan:
  """Context parallelism (`cp_*`): the zigzag split of the whole `[x_t ; x_0]` stream (2P
  chunks, rank r holds r and 2P-1-r, so chunk r < P is noisy and 2P-1-r clean); all K/V
  travel. A drafter's two streams are zigzagged each on its own."""
  if draft_blocks:
    return _draft_zigzag(name, L, B, P, draft_blocks)
  if not noisy_stream:
    return LayoutPlan(name, L, B, zigzag(L, P, offset=L).astype(np.int32), 0, "all")
  if L % P:
    raise ConfigError(
        f"{name} splits 2L={2 * L} rows into 2*seq={2 * P} chunks; data.seq_len must be "
        f"divisible by parallel.seq")
  return LayoutPlan(name, L, B, zigzag(2 * L, P).astype(np.int32), L // P, "all")


def balanced_zigzag_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                         draft_blocks: int = 0) -> LayoutPlan:
  """`cp_ring_balanced`: each half of the stream zigzagged on its own in whole blocks, so
  every ring step, not only the whole step, gives each rank the same work."""
  if draft_blocks or not noisy_stream:
    return zigzag_plan(name, L, B, P, noisy_stream, draft_blocks)
  return LayoutPlan(name, L, B, _zigzag_halves(L, B, P).astype(np.int32), L // P, "all")


def _owned_noisy(name: str, L: int, B: int, P: int, noisy_stream: bool, draft_blocks: int):
  """Each rank's corrupted (or draft) blocks, dual-end pairs: the rows of its noisy slot."""
  if not noisy_stream:
    raise ConfigError(f"strategy {name!r} needs a corrupted stream (a diffusion objective)")
  if draft_blocks:
    if draft_blocks < P:
      raise ConfigError(f"objective.max_anchors={draft_blocks} draft blocks cannot be split "
                        f"over parallel.seq={P} ranks: every rank needs one")
    return assign_blocks(draft_blocks, P)
  if L % B:
    raise ConfigError(f"data.seq_len={L} is not a multiple of objective.block_size={B}")
  return assign_blocks(L // B, P)


def replicated_prefix_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                           draft_blocks: int = 0) -> LayoutPlan:
  """Block parallelism (`bp`): each rank owns whole corrupted blocks and replicates the
  clean prefix up to its last one (a drafter's whole context: an anchor's prefix is only
  known with the data); nothing travels."""
  owned = _owned_noisy(name, L, B, P, noisy_stream, draft_blocks)
  noisy = _pad_rows([_block_rows(blocks, B) for blocks in owned])
  if draft_blocks:
    n = draft_blocks * B
    clean = np.tile(n + np.arange(L), (P, 1))
  else:
    clean = _pad_rows([L + np.arange(max(blocks) * B) for blocks in owned])
  return LayoutPlan(name, L, B, np.concatenate([noisy, clean], axis=1).astype(np.int32),
                    noisy.shape[1], "none", draft_blocks)


def sharded_context_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                         draft_blocks: int = 0) -> LayoutPlan:
  """Context-sharded block parallelism (`csbp_*`): corrupted blocks owned as under `bp`, the
  clean stream zigzagged; only clean K/V travel."""
  owned = _owned_noisy(name, L, B, P, noisy_stream, draft_blocks)
  noisy = _pad_rows([_block_rows(blocks, B) for blocks in owned])
  clean = zigzag(L, P, offset=draft_blocks * B if draft_blocks else L)
  return LayoutPlan(name, L, B, np.concatenate([noisy, clean], axis=1).astype(np.int32),
                    noisy.shape[1], "clean", draft_blocks)


def replicated_drafts_plan(name: str, L: int, B: int, P: int, noisy_stream: bool = True,
                           draft_blocks: int = 0) -> LayoutPlan:
  """The seed paper's pure-CP DFlash baseline (its `all_blocks` mode when BP = 1): every rank
  holds all A draft blocks, replicated as `bp` replicates the clean prefix (so the drafter's
  layers, head and losses run A*B rows on every rank), and one zigzag shard of the context;
  only context K/V travel."""
  if not draft_blocks:
    raise ConfigError(f"strategy {name!r} replicates a drafter's draft blocks on every rank: "
                      f"it needs a drafter objective (objective.name=dflash)")
  n = draft_blocks * B
  drafts = np.tile(np.arange(n), (P, 1))
  rows = np.concatenate([drafts, zigzag(L, P, offset=n)], axis=1).astype(np.int32)
  return LayoutPlan(name, L, B, rows, n, "clean", draft_blocks)


def _draft_zigzag(name: str, L: int, B: int, P: int, A: int) -> LayoutPlan:
  """A drafter's cp layout: A*B draft rows (sorted by anchor) and the L context rows, each
  zigzagged on its own; everything travels."""
  n = A * B
  if n % (2 * P):
    raise ConfigError(f"{name} zigzags the objective.max_anchors*objective.block_size="
                      f"{n} draft rows over 2*parallel.seq={2 * P} chunks: they must divide")
  rows = np.concatenate([zigzag(n, P), zigzag(L, P, offset=n)], axis=1).astype(np.int32)
  return LayoutPlan(name, L, B, rows, n // P, "all", draft_blocks=A)


def apply_layout(plan: LayoutPlan, logical: dict[str, np.ndarray],
                 pad_values: dict[str, int]) -> dict[str, np.ndarray]:
  """Gathers logical [S, 2L] arrays into layout order [S, P * rows_per_rank]."""
  flat = plan.rows.reshape(-1)
  is_pad = flat == PAD
  idx = np.where(is_pad, 0, flat)
  return {name: np.where(is_pad[None], pad_values[name], x[:, idx]).astype(x.dtype)
          for name, x in logical.items()}
