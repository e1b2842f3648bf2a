"""What a plan asks of each rank: attention pairs split by whose K/V they read, the bytes
its transport sends, and the model's share of FLOPs and parameters.

Pairs come from `LayoutPlan.attention_work` (the one count of the mask), FLOPs and
parameters from `bdlm_jax.metrics`, bytes from `analysis.step_report.attention_traffic`:
the cost model repeats none of them.
"""

import dataclasses
import functools

import numpy as np

from bdlm_jax.analysis.cost_model.setting import Assumptions
from bdlm_jax.analysis.hlo_stats import COLLECTIVE_KINDS, wire_bytes
from bdlm_jax.analysis.step_report import attention_traffic
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.metrics import model_flops_per_step
from bdlm_jax.models.moe import capacity
from bdlm_jax.models.pattern import layer_types, mlp_types
from bdlm_jax.models.transformer import reruns_attention
from bdlm_jax.parallel.layout import LayoutPlan
from bdlm_jax.parallel.registry import SINGLE_DEVICE, get_strategy, make_plan, strategy_names


@dataclasses.dataclass(frozen=True)
class PlanWork:
  """What one plan asks of each rank, independent of the model."""
  plan: LayoutPlan
  stay_pairs: np.ndarray  # int64 [P]: queries of rank r x its stay K/V
  travel_pairs: np.ndarray  # int64 [P, P]: queries of rank r x travelling K/V of rank s
  n_stay: int  # local K/V rows that never travel
  n_travel: int  # K/V rows each rank sends
  _windowed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  @property
  def transport(self) -> str:
    return get_strategy(self.plan.strategy).transport

  def windowed_pairs(self, window: int) -> np.ndarray:
    """int64 [P]: each rank's pairs on a local layer (`attention_work(window)`), counted once
    per plan however many scenarios and models ask."""
    if window not in self._windowed:
      self._windowed[window] = self.plan.attention_work(window)
    return self._windowed[window]

  def executed(self, tile_skipping: bool):
    """(stay [P], travel [P, P]) pairs the kernel computes: only allowed pairs when it skips
    masked tiles, else every pair of each visit that has any allowed pair."""
    if tile_skipping:
      return self.stay_pairs, self.travel_pairs
    rows = self.plan.rows_per_rank
    return (np.where(self.stay_pairs > 0, rows * self.n_stay, 0),
            np.where(self.travel_pairs > 0, rows * self.n_travel, 0))


def work_of(plan: LayoutPlan, window: int | None = None,
            causal_drafts: bool = False) -> PlanWork:
  """`PlanWork` of any plan ([x_t ; x_0], a drafter's, an autoregressive one): its K/V rows
  split into the part that stays (everything, when nothing travels) and the part that
  travels, and `attention_work` (on a layer of `window`, if given; draft blocks causal
  inside, if `causal_drafts`) counted against each."""
  split = plan.rows_per_rank if plan.travel == "none" else plan.n_stay
  work = lambda keys: plan.attention_work(window, keys=keys, causal_drafts=causal_drafts)
  return PlanWork(plan, np.diagonal(work(plan.rows[:, :split])), work(plan.rows[:, split:]),
                  split, plan.rows_per_rank - split)


def plan_work(strategy: str, seq_len: int, block_size: int, num_ranks: int,
              draft_blocks: int = 0) -> PlanWork:
  return work_of(make_plan(strategy, seq_len, block_size, num_ranks,
                           draft_blocks=draft_blocks))


def context_work(strategy: str, seq_len: int, num_ranks: int) -> PlanWork:
  """A drafter's frozen target, a causal forward over the L context rows: context parallel
  on the very zigzag shards the context rows sit on, every row's K/V travelling on the
  strategy's transport; over the whole context on every rank where nothing travels (bp
  replicates the context; one rank)."""
  return _context_work(get_strategy(strategy).transport, seq_len, num_ranks)


@functools.lru_cache(maxsize=8)
def _context_work(transport: str, seq_len: int, num_ranks: int) -> PlanWork:
  if transport == "local":
    return work_of(make_plan(SINGLE_DEVICE, seq_len, 1, 1, noisy_stream=False))
  context_parallel = strategy_names(transport=transport, travels="all")[0]
  return work_of(make_plan(context_parallel, seq_len, 1, num_ranks, noisy_stream=False))


def attention_kinds(m: ModelConfig) -> list[tuple[int | None, int]]:
  """(window, layer count) of each attention kind the model has: None for its global layers,
  `sliding_window` for its local ones (`layer_types`)."""
  kinds = layer_types(m)
  return [(window, n) for window, n in ((None, kinds.count("global")),
                                        (m.sliding_window, kinds.count("local"))) if n]


def bd3lm_config(m: ModelConfig, seq_len: int, block_size: int) -> Config:
  """The config of one sequence of `m` under the default objective."""
  return replace(Config(), model=dataclasses.asdict(m), data=dict(seq_len=seq_len),
                 objective=dict(block_size=block_size), train=dict(batch_size=1))


def useful_flops(m: ModelConfig, seq_len: int, block_size: int) -> float:
  """Useful FLOPs of one sequence's step: `model_flops_per_step` (a local layer counts its
  windowed pairs, an MoE its active parameters)."""
  return model_flops_per_step(bd3lm_config(m, seq_len, block_size))


def moe_layers(m: ModelConfig) -> int:
  return mlp_types(m).count("moe")


def expert_params(m: ModelConfig) -> int:
  """Every MoE layer's expert weights: under expert parallelism they stay where they are used
  (never gathered by ZeRO-3, their gradients never reduced)."""
  return moe_layers(m) * m.moe_experts * 3 * m.d_model * (m.moe_d_ff or m.d_ff)


def expert_slots(m: ModelConfig, rows: int, num_gpus: int) -> tuple[int, int]:
  """(pairs, receive slots) of one GPU's MoE layer, experts split over `num_gpus`
  (`parallel.experts`): its rows' k (token, expert) pairs, and the rows its experts may
  receive, the group's pairs bounded by their capacity (`models.moe.capacity`)."""
  pairs = rows * m.moe_top_k
  cap = capacity(m, num_gpus * rows)
  group = num_gpus * pairs
  return pairs, group if cap is None else min(group, m.moe_experts // num_gpus * cap)


def kv_row(m: ModelConfig) -> int:
  """K and V elements of one row."""
  return 2 * m.n_kv_heads * m.head_dim


def step_comm_bytes(work: PlanWork, m: ModelConfig, a: Assumptions) -> float:
  """Bytes each rank sends for attention in one step (at `a`'s dtypes and metadata): what
  the transport issues per layer kind (`attention_traffic`: the ring shifts K/V + metadata
  P-1 times forward and P-1 times backward and the dK/dV P times; the all-gather gathers K/V
  + metadata forward and again backward and reduce-scatters the dK/dV; a local layer's
  windowed exchange sends the rows its windows reach and takes their dK/dV back; a ring's
  or an exchange's forward once more where the backward re-runs it, `rerun_sends`), as ring
  algorithms send it (`wire_bytes`)."""
  kv = kv_row(m)
  totals = [attention_traffic(work.plan, kv * a.compute_bytes, kv * a.kv_grad_bytes,
                              a.meta_bytes_per_row, n, window,
                              reruns=reruns_attention(m.remat))
            for window, n in attention_kinds(m)]
  traffic = {kind: sum(t[kind] for t in totals) for kind in COLLECTIVE_KINDS}
  return wire_bytes(traffic, work.plan.num_ranks)


def distinct_plans(strategies, seq_len: int, block_size: int, num_ranks: int,
                   draft_blocks: int = 0) -> tuple[str, ...]:
  """`strategies` less those whose plan (rows and what travels) and transport repeat an
  earlier one's (a drafter's cp_ring_balanced is cp_ring: each of its streams is zigzagged
  on its own already)."""
  seen, out = set(), []
  for name in strategies:
    record = get_strategy(name)
    plan = make_plan(name, seq_len, block_size, num_ranks if record.splits_sequences else 1,
                     draft_blocks=draft_blocks)
    key = (record.transport, plan.travel, plan.rows.tobytes())
    if key not in seen:
      seen.add(key)
      out.append(name)
  return tuple(out)
