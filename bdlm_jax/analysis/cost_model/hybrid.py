"""Gated DeltaNet hybrids projected at the seed's conversion setting (docs/gdn.md): this
package's chain under csbp_ring and under cp_ring, against the seed's head-parallel GDN
(`gdn.ULYSSES`) beside csbp_ring's attention, the seed's own layout for its attention."""

import dataclasses

from bdlm_jax.analysis.cost_model import gdn
from bdlm_jax.analysis.cost_model.setting import GDN_MODELS, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.timing import step_time
from bdlm_jax.analysis.cost_model.work import work_of
from bdlm_jax.analysis.plan_mode import batched, sequences
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.parallel.registry import STRATEGIES, plan_for


def _ring(travels: str) -> str:
  """The first registered ring strategy of a block-diffusion layout moving `travels` K/V:
  csbp_ring for "clean", cp_ring for "all"."""
  return next(s.name for s in STRATEGIES.values()
              if s.transport == "ring" and s.travels == travels and not s.needs_drafter)


# (attention strategy, GDN transport) of each row: ours, CP's, the seed's.
VARIANTS = ((_ring("clean"), gdn.CHAIN), (_ring("all"), gdn.CHAIN), (_ring("clean"), gdn.ULYSSES))
SEQ_LEN, BLOCK_SIZE = 256 * 1024, 256  # the seed's conversion recipe (fast_dllm_v2)


def conversion_config(m: ModelConfig, strategy: str, num_ranks: int, seq_len: int = SEQ_LEN,
                      block_size: int = BLOCK_SIZE) -> Config:
  """One sequence of the seed's conversion recipe: fast_dllm_v2 (two complementary copies)
  over `num_ranks`, under full remat (the cost model's assumption)."""
  return replace(Config(), model=dataclasses.asdict(dataclasses.replace(m, remat="full")),
                 data=dict(seq_len=seq_len),
                 objective=dict(name="fast_dllm_v2", block_size=block_size),
                 parallel=dict(strategy=strategy, seq=num_ranks), train=dict(batch_size=1))


def hybrid_rows(hw: Hardware, models=GDN_MODELS, variants=VARIANTS, **setting) -> list[dict]:
  """One row per (model, variant): the step of one batch (both copies, timed as one
  sequence at half of every rate, `plan_mode.batched`), its GDN part, what each rank sends
  a step for attention and for GDN layers, the f32 state bytes one GDN layer keeps for its
  backward (one copy), and csbp_ring + chain's speedup over it."""
  a = Assumptions()
  rows = []
  for name, m in models.items():
    for strategy, transport in variants:
      cfg = conversion_config(m, strategy, hw.num_gpus, **setting)
      work = work_of(plan_for(cfg))
      t = step_time(cfg.model, work, batched(hw, cfg), a, transport)
      copies = sequences(cfg)
      rows.append(dict(
          model=name, seq_len=cfg.data.seq_len, block_size=cfg.objective.block_size,
          objective=cfg.objective.name, strategy=strategy, gdn_transport=transport,
          total_s=t["total_s"], gdn_s=t["gdn_s"], gdn_wait_s=t["gdn_s"] - t["gdn_busy_s"],
          attention_s=t["attention_s"],
          attention_bytes_per_step=copies * t["comm_bytes_per_step"],
          gdn_bytes_per_step=copies * t["gdn_comm_bytes_per_step"],
          gdn_state_bytes=gdn.layer_work(cfg.model, work.plan, transport).state_bytes))
  for r in rows:
    ours = next(x for x in rows if x["model"] == r["model"]
                and (x["strategy"], x["gdn_transport"]) == VARIANTS[0])
    r["csbp_speedup"] = r["total_s"] / ours["total_s"]
  return rows
