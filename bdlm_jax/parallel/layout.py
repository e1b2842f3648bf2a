"""Static layout plans: which logical rows of `[x_t ; x_0]` each rank of the `seq` axis holds.

A plan is pure data, computed once in NumPy from (L, B, P). Logical row r < L is the noisy
(corrupted) token at position r; row L + p is the clean token at position p. A drafter
objective (dflash) has A draft blocks of B rows as its noisy stream instead: rows r < A*B,
then the clean context A*B + p (`noisy_len`). Every rank
holds the same number of rows: first its *noisy slot* (`n_noisy` rows), then its *clean
slot*; -1 marks a padding row. `travel` says which local K/V must visit other ranks:

  none   nothing travels (single device, or `bp`, which replicates the clean prefix)
  all    every local K/V row travels (`cp_*`: the whole stream is context-parallel)
  clean  only the clean slot travels (`csbp_*`: corrupted K/V never leave their rank)

Adding a strategy means adding a plan here; the model and the objective never change.
"""

import dataclasses
import functools

import numpy as np

from bdlm_jax.config import ConfigError

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

  @property
  def noisy_len(self) -> int:
    """Logical noisy rows; the clean row of position p is `noisy_len + p`."""
    return self.draft_blocks * self.block_size if self.draft_blocks else self.seq_len

  def block_starts(self) -> np.ndarray:
    """int64 [noisy blocks]: the clean context each noisy block sees, as its first position.

    A draft block's anchor depends on the data; here the j-th of A sorted anchors sits at its
    expected place, (j + 1) * L / (A + 1) (uniform anchors), so static costs can use it.
    """
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

  def attention_work(self, window: int | None = None) -> np.ndarray:
    """Allowed (query, key) pairs each rank computes, int64 [P] (one document, no padding),
    on a global layer or a local one of window W.

    A noisy query in block b sees its own block and b earlier clean blocks: B*(b+1) keys;
    a clean query in block b sees blocks 0..b: B*(b+1) keys too. A window keeps a noisy
    query's W-1 clean keys before bB, and a clean query's keys from p - (W-1) on. A draft
    query sees its block and the context before its anchor (`block_starts`); the context
    rows are keys only.
    """
    B, n = self.block_size, self.noisy_len
    valid = self.rows != PAD
    noisy = self.rows < n
    pos = np.where(noisy, self.rows, self.rows - n)
    start = np.where(noisy, self.block_starts()[np.where(noisy, self.rows, 0) // B],
                     pos // B * B)
    if window is None:
      keys = start + B
    else:
      keys = np.where(noisy, B + np.minimum(window - 1, start),
                      start + B - np.maximum(0, pos - (window - 1)))
    if self.draft_blocks:
      keys = np.where(noisy, keys, 0)
    return np.where(valid, keys, 0).sum(axis=1).astype(np.int64)

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


def make_plan(strategy: str, seq_len: int, block_size: int, num_ranks: int,
              noisy_stream: bool = True, draft_blocks: int = 0) -> LayoutPlan:
  """The layout of `strategy` for one sequence of `seq_len` tokens on `num_ranks` ranks.

  `noisy_stream=False` is the autoregressive case: only the clean stream exists.
  `draft_blocks` A > 0 is a drafter's: A draft blocks ahead of the clean context.
  """
  if strategy == "none" and num_ranks != 1:
    raise ConfigError("strategy 'none' runs on one seq rank; set parallel.seq=1")
  if draft_blocks:
    return _draft_plan(strategy, seq_len, block_size, num_ranks, draft_blocks)
  L, B, P = seq_len, block_size, num_ranks
  plan = lambda rows, n_noisy, travel: LayoutPlan(strategy, L, B, np.asarray(rows, np.int32),
                                                  n_noisy, travel)
  if strategy == "none":
    rows = np.arange(2 * L) if noisy_stream else np.arange(L, 2 * L)
    return plan(rows[None], L if noisy_stream else 0, "none")
  if strategy in ("cp_ring", "cp_allgather", "cp_ring_balanced"):
    if not noisy_stream:
      return plan(zigzag(L, P, offset=L), 0, "all")
    if strategy == "cp_ring_balanced":
      return plan(_zigzag_halves(L, B, P), L // P, "all")
    # Zigzag over the whole 2L stream: chunk r < P is noisy, chunk 2P-1-r is clean.
    if L % P:
      raise ConfigError(
          f"{strategy} splits 2L={2 * L} rows into 2*seq={2 * P} chunks; data.seq_len must be "
          f"divisible by parallel.seq")
    return plan(zigzag(2 * L, P), L // P, "all")
  if not noisy_stream:
    raise ConfigError(f"strategy {strategy!r} needs a corrupted stream (a diffusion objective)")
  if L % B:
    raise ConfigError(f"data.seq_len={L} is not a multiple of objective.block_size={B}")
  owned = assign_blocks(L // B, P)
  noisy = [_block_rows(blocks, B) for blocks in owned]
  n_noisy = max(len(n) for n in noisy)
  if strategy == "bp":
    clean = [L + np.arange(max(blocks) * B) for blocks in owned]
    travel = "none"
  elif strategy in ("csbp_ring", "csbp_allgather"):
    clean = list(zigzag(L, P, offset=L))
    travel = "clean"
  else:
    raise ConfigError(f"unknown parallel.strategy {strategy!r}")
  noisy_slot, clean_slot = _pad_rows(noisy), _pad_rows(clean)
  return plan(np.concatenate([noisy_slot, clean_slot], axis=1), n_noisy, travel)


def _draft_plan(strategy: str, L: int, B: int, P: int, A: int) -> LayoutPlan:
  """A drafter's layout (DESIGN.md section 10): A draft blocks (rows [0, A*B), sorted by
  anchor, so block j's context width grows with j) and the clean context (rows A*B + p).

  none: everything on one rank. cp_*: each stream zigzagged by rows, everything travels.
  bp: draft blocks owned by ranks (dual-end pairs, as BD3-LM's blocks), the whole context
  replicated (a block's anchor, hence its prefix, is only known with the data). csbp_*: the
  same draft blocks, the context zigzagged; only the context travels.
  """
  n = A * B
  plan = lambda rows, n_noisy, travel: LayoutPlan(strategy, L, B, np.asarray(rows, np.int32),
                                                  n_noisy, travel, draft_blocks=A)
  if strategy == "none":
    return plan(np.arange(n + L)[None], n, "none")
  if strategy in ("cp_ring", "cp_allgather", "cp_ring_balanced"):
    if n % (2 * P):
      raise ConfigError(f"{strategy} zigzags the objective.max_anchors*objective.block_size="
                        f"{n} draft rows over 2*parallel.seq={2 * P} chunks: they must divide")
    return plan(np.concatenate([zigzag(n, P), zigzag(L, P, offset=n)], axis=1), n // P, "all")
  if strategy not in ("bp", "csbp_ring", "csbp_allgather"):
    raise ConfigError(f"unknown parallel.strategy {strategy!r}")
  if A < P:
    raise ConfigError(f"objective.max_anchors={A} draft blocks cannot be split over "
                      f"parallel.seq={P} ranks: every rank needs one")
  noisy = _pad_rows([_block_rows(blocks, B) for blocks in assign_blocks(A, P)])
  clean = (np.tile(n + np.arange(L), (P, 1)) if strategy == "bp"
           else zigzag(L, P, offset=n))
  return plan(np.concatenate([noisy, clean], axis=1), noisy.shape[1],
              "none" if strategy == "bp" else "clean")


def apply_layout(plan: LayoutPlan, logical: dict[str, np.ndarray],
                 pad_values: dict[str, int]) -> dict[str, np.ndarray]:
  """Gathers logical [S, 2L] arrays into layout order [S, P * rows_per_rank]."""
  flat = plan.rows.reshape(-1)
  is_pad = flat == PAD
  idx = np.where(is_pad, 0, flat)
  return {name: np.where(is_pad[None], pad_values[name], x[:, idx]).astype(x.dtype)
          for name, x in logical.items()}
