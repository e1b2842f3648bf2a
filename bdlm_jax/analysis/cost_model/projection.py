"""Every (model, L, B, strategy, scenario) of the projection, and CSBP's speedup from them."""

from bdlm_jax.analysis.cost_model.memory import compiled_peak, peak_memory
from bdlm_jax.analysis.cost_model.setting import BLOCK_SIZES, MODELS, SEQ_LENS, Hardware
from bdlm_jax.analysis.cost_model.timing import step_time
from bdlm_jax.analysis.cost_model.work import plan_work, useful_flops
from bdlm_jax.parallel.registry import strategy_names

STRATEGIES = strategy_names(splits_sequences=True)
CSBP = strategy_names(travels="clean")  # context-sharded BP: only the clean K/V travel
BASELINES = tuple(s for s in STRATEGIES if s not in CSBP)  # what CSBP is measured against


def project(hw: Hardware, scenarios: dict, models=MODELS, seq_lens=SEQ_LENS,
            block_sizes=BLOCK_SIZES, strategies=STRATEGIES, compiled=None) -> dict:
  """{scenario: one row per (model, L, B, strategy)}; each plan is built once. `mfu` is the
  useful FLOPs (`useful_flops`) over the step time at peak on every GPU. `memory_bytes` (and
  the fits verdict) is the compiled peak where `compiled` (`load_probe`) has the setting,
  else the assumed `total_bytes`."""
  compiled = compiled or {}
  out = {name: [] for name in scenarios}
  for seq_len in seq_lens:
    for block_size in block_sizes:
      useful = {name: useful_flops(m, seq_len, block_size) for name, m in models.items()}
      for s in strategies:
        work = plan_work(s, seq_len, block_size, hw.num_gpus)
        for scenario, a in scenarios.items():
          for name, m in models.items():
            row = dict(model=name, seq_len=seq_len, block_size=block_size, strategy=s,
                       **step_time(m, work, hw, a), **peak_memory(m, work, hw, a))
            row["compiled_bytes"] = compiled_peak(compiled, name, seq_len, block_size, s)
            row["compiled_here"] = (name, seq_len, block_size, s) in compiled
            row["memory_bytes"] = row["compiled_bytes"] or row["total_bytes"]
            row["fits"] = row["memory_bytes"] <= hw.usable_bytes
            row["mfu"] = useful[name] / (row["total_s"] * hw.num_gpus * hw.peak_tflops * 1e12)
            out[scenario].append(row)
  return out


def idle_fraction(row: dict | None) -> float | None:
  """Share of the step spent communicating (an MoE's token exchange too) or waiting for ring
  neighbours."""
  if row is None:
    return None
  return (row["attention_s"] - row["attention_busy_s"] + row["moe_exchange_s"]) / row["total_s"]


def speedups(rows: list[dict]) -> list[dict]:
  """Per (model, L, B): best CSBP over the best baseline, each among strategies that fit."""
  out = []
  keys = sorted({(r["model"], r["seq_len"], r["block_size"]) for r in rows},
                key=lambda k: (list(MODELS).index(k[0]), k[1], k[2]))
  for key in keys:
    group = [r for r in rows if (r["model"], r["seq_len"], r["block_size"]) == key]
    fit = lambda names: [r for r in group if r["strategy"] in names and r["fits"]]
    base = min(fit(BASELINES), key=lambda r: r["total_s"], default=None)
    csbp = min(fit(CSBP), key=lambda r: r["total_s"], default=None)
    out.append(dict(model=key[0], seq_len=key[1], block_size=key[2],
                    baseline=base["strategy"] if base else None,
                    csbp=csbp["strategy"] if csbp else None,
                    speedup=base["total_s"] / csbp["total_s"] if base and csbp else None,
                    memory_ratio=csbp["memory_bytes"] / base["memory_bytes"]
                    if base and csbp else None,
                    baseline_idle=idle_fraction(base), csbp_idle=idle_fraction(csbp),
                    csbp_mfu=csbp["mfu"] if csbp else None))
  return out
