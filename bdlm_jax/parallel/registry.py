"""The strategy registry: every sequence strategy is one `Strategy` record here.

A strategy is data, a static layout plan (`layout.py`), plus one attention transport that
moves the plan's travelling K/V: `local` (nothing moves), `ring` (`ppermute` around the seq
axis, ring.py) or `allgather` (one all-gather, allgather.py). Config validation, the step,
the traffic report, `mode=plan`, the cost model and the benchmarks all read their lists and
properties from `STRATEGIES`; adding a strategy means one `register(Strategy(...))` with
its plan builder, and nothing else changes.
"""

import dataclasses
import functools
from typing import Callable

from bdlm_jax import objectives
from bdlm_jax.config import Config
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel import layout
from bdlm_jax.parallel.layout import LayoutPlan

TRANSPORTS = ("local", "ring", "allgather")
SINGLE_DEVICE = "none"  # the strategy of one device: the reference every other one equals


@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  # builder(name, L, B, P, noisy_stream, draft_blocks) -> LayoutPlan
  plan: Callable[..., LayoutPlan]
  transport: str  # one of TRANSPORTS
  # What the transport moves, as the plan's `travel`: "none", "all" (noisy and clean K/V),
  # or "clean" (only the shared clean K/V: block parallelism's point)
  travels: str
  baseline: bool  # a published baseline we compare block parallelism against
  summary: str
  # Whether its ranks own whole corrupted blocks, so it needs a diffusion objective's
  # corrupted stream (an autoregressive objective has none)
  needs_noisy_stream: bool = False
  # Whether its plan exists only for a drafter's draft blocks (a drafter objective: dflash)
  needs_drafter: bool = False

  def __post_init__(self):
    if self.transport not in TRANSPORTS:
      raise ValueError(f"strategy {self.name!r}: transport {self.transport!r} is not one of "
                       f"{TRANSPORTS}")

  @property
  def splits_sequences(self) -> bool:
    """Whether it splits one sequence over the seq axis (all but the one-device `none`)."""
    return self.name != SINGLE_DEVICE


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
  """Adds `strategy` (a new name) to the registry and returns it."""
  if strategy.name in STRATEGIES:
    raise ValueError(f"strategy {strategy.name!r} is registered already")
  STRATEGIES[strategy.name] = strategy
  return strategy


def unregister(name: str) -> None:
  """Removes a strategy (a test's toy one)."""
  del STRATEGIES[name]


def get_strategy(name: str) -> Strategy:
  if name not in STRATEGIES:
    raise ConfigError(f"parallel.strategy={name!r} is not one of {list(STRATEGIES)}")
  return STRATEGIES[name]


def strategy_names(**properties) -> tuple[str, ...]:
  """Registered names in registration order, those with the properties given (e.g.
  `strategy_names(splits_sequences=True, baseline=False)`)."""
  return tuple(s.name for s in STRATEGIES.values()
               if all(getattr(s, k) == v for k, v in properties.items()))


def strategy_names_for(objective_name: str, **properties) -> tuple[str, ...]:
  """`strategy_names(**properties)` that can train objective `objective_name`: a strategy
  for drafters only (`needs_drafter`) where the objective trains a drafter."""
  drafter = objectives.get_objective(objective_name).DRAFTER
  return tuple(name for name in strategy_names(**properties)
               if drafter or not STRATEGIES[name].needs_drafter)


def make_plan(strategy: str, seq_len: int, block_size: int, num_ranks: int,
              noisy_stream: bool = True, draft_blocks: int = 0) -> LayoutPlan:
  """The layout of `strategy` for one sequence of `seq_len` tokens on `num_ranks` ranks.

  `noisy_stream=False` is the autoregressive case: only the clean stream exists.
  `draft_blocks` A > 0 is a drafter's: A draft blocks ahead of the clean context.
  """
  record = get_strategy(strategy)
  plan = record.plan(strategy, seq_len, block_size, num_ranks, noisy_stream, draft_blocks)
  if plan.travel != record.travels:
    raise ValueError(f"strategy {strategy!r} is registered as moving {record.travels!r} K/V, "
                     f"but its plan moves {plan.travel!r}")
  return plan


@functools.lru_cache(maxsize=64)
def _cached_plan(strategy, seq_len, block_size, num_ranks, noisy_stream, draft_blocks):
  return make_plan(strategy, seq_len, block_size, num_ranks, noisy_stream, draft_blocks)


def plan_for(cfg: Config) -> LayoutPlan:
  """The layout plan `cfg` trains with (cached: plans are static)."""
  objective = objectives.get_objective(cfg.objective.name)
  noisy = objective.NOISY_STREAM
  block = cfg.objective.block_size if noisy else 1
  drafts = cfg.objective.max_anchors if objective.DRAFTER else 0
  return _cached_plan(cfg.parallel.strategy, cfg.data.seq_len, block, cfg.parallel.seq, noisy,
                      drafts)


register(Strategy(SINGLE_DEVICE, layout.single_device_plan, "local", "none", baseline=False,
                  summary="one device holds the whole sequence"))
register(Strategy("cp_allgather", layout.zigzag_plan, "allgather", "all", baseline=True,
                  summary="context parallelism: zigzag stream, all K/V all-gathered"))
register(Strategy("cp_ring", layout.zigzag_plan, "ring", "all", baseline=True,
                  summary="ring attention: zigzag stream, all K/V around the ring"))
register(Strategy("cp_ring_balanced", layout.balanced_zigzag_plan, "ring", "all",
                  baseline=True,
                  summary="ring attention, each half zigzagged: equal work at every step"))
register(Strategy("bp", layout.replicated_prefix_plan, "local", "none", baseline=False,
                  summary="block parallelism: owned blocks, clean prefix replicated",
                  needs_noisy_stream=True))
register(Strategy("csbp_allgather", layout.sharded_context_plan, "allgather", "clean",
                  baseline=False,
                  summary="context-sharded BP: owned blocks, clean K/V all-gathered",
                  needs_noisy_stream=True))
register(Strategy("csbp_ring", layout.sharded_context_plan, "ring", "clean", baseline=False,
                  summary="context-sharded BP: owned blocks, clean K/V around the ring",
                  needs_noisy_stream=True))
register(Strategy("cp_replicated_drafts", layout.replicated_drafts_plan, "ring", "clean",
                  baseline=True,
                  summary="the DFlash paper's CP baseline: every draft block on every rank, "
                          "context K/V around the ring",
                  needs_noisy_stream=True, needs_drafter=True))


def drafter_plan(cfg: Config, strategy: str, num_ranks: int) -> LayoutPlan:
  """A drafter's plan for static costs (the cost model, MFU): its `objective.max_anchors`
  draft blocks where its anchors are expected, `locality` anchors as one run mid-sequence
  (`objectives.dflash.locality_run`), others spread evenly (`LayoutPlan.block_starts`)."""
  o = cfg.objective
  plan = make_plan(strategy, cfg.data.seq_len, o.block_size, num_ranks,
                   draft_blocks=o.max_anchors)
  if o.anchors != "locality":
    return plan
  return dataclasses.replace(plan, anchor_starts=objectives.dflash.locality_run(
      cfg.data.seq_len, o.max_anchors, o.block_size))
