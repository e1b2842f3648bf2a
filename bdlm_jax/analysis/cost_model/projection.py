"""Every (model, L, B, strategy, scenario) of the projection, and CSBP's speedup from them."""

import dataclasses

from bdlm_jax.analysis.cost_model.memory import compiled_peak, peak_memory
from bdlm_jax.analysis.cost_model.setting import (BLOCK_SIZES, GB, MODELS, OFFLOAD_TOLERANCE,
                                                  SCALING_SEQ_LENS, SEQ_LENS, Assumptions,
                                                  Hardware, host_link_c2c)
from bdlm_jax.analysis.cost_model.timing import param_traffic_s, step_time
from bdlm_jax.analysis.cost_model.work import plan_work, useful_flops
from bdlm_jax.parallel.registry import strategy_names

STRATEGIES = strategy_names(splits_sequences=True, needs_drafter=False)
# context-sharded BP: only the clean K/V travel (not a baseline that replicates the drafts)
CSBP = strategy_names(travels="clean", baseline=False)
BASELINES = tuple(s for s in STRATEGIES if s not in CSBP)  # what CSBP is measured against


def project(hw: Hardware, scenarios: dict, models=MODELS, seq_lens=SEQ_LENS,
            block_sizes=BLOCK_SIZES, strategies=STRATEGIES, compiled=None) -> dict:
  """{scenario: one row per (model, L, B, strategy)}; each plan is built once. `mfu` is the
  useful FLOPs (`useful_flops`) over the step time at peak on every GPU. `memory_bytes` (and
  the fits verdict) is the compiled figure where `compiled` (`load_probe`) has the setting,
  else the assumed `total_bytes`; `memory_source` says which (`Compiled`, or "assumed")."""
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
            figure = compiled_peak(compiled, name, seq_len, block_size, s)
            row["compiled_bytes"] = figure.nbytes if figure else None
            row["memory_source"] = figure.source if figure else "assumed"
            row["compiled_here"] = (name, seq_len, block_size, s) in compiled
            row["memory_bytes"] = row["compiled_bytes"] or row["total_bytes"]
            row["fits"] = row["memory_bytes"] <= hw.usable_bytes
            row["mfu"] = useful[name] / (row["total_s"] * hw.num_gpus * hw.peak_tflops * 1e12)
            out[scenario].append(row)
  return out


def offload_rows(hw: Hardware, models=MODELS, seq_lens=SEQ_LENS, block_size: int = 64,
                 strategies=STRATEGIES, compiled=None) -> list[dict]:
  """Per (model, L, strategy): the step under `model.remat=full` (its memory and fits verdict
  as `project` gives them, compiled where `compiled` has the setting) next to `offload` (the
  residuals' host bytes and copy time, what of it is exposed; its device memory assumed),
  whether offload stays within `OFFLOAD_TOLERANCE` of full where full fits, and
  `offload_input` (half the host bytes, the attention forward re-run)."""
  by_remat = {remat: project(hw, {"default": Assumptions()},
                             {n: dataclasses.replace(m, remat=remat) for n, m in models.items()},
                             seq_lens, (block_size,), strategies,
                             compiled if remat == "full" else None)["default"]
              for remat in ("full", "offload", "offload_input")}
  out = []
  for full, off, inp in zip(*by_remat.values()):
    slowdown = off["total_s"] / full["total_s"]
    out.append(dict(
        model=full["model"], seq_len=full["seq_len"], block_size=block_size,
        strategy=full["strategy"], host_gb_s=hw.host_gb_s, full_s=full["total_s"],
        full_memory_bytes=full["memory_bytes"], full_memory_source=full["memory_source"],
        full_fits=full["fits"], full_assumed_bytes=full["total_bytes"], offload_s=off["total_s"],
        offload_device_bytes=off["total_bytes"], offload_fits=off["fits"],
        host_bytes=off["host_bytes"],
        host_fits=off["host_bytes"] * hw.gpus_per_node <= hw.host_gb_per_node * GB,
        host_bytes_per_step=off["host_bytes_per_step"],
        host_copy_s=off["host_copy_s"], host_exposed_s=off["host_exposed_s"],
        slowdown=slowdown,
        within_tolerance=slowdown <= 1 + OFFLOAD_TOLERANCE if full["fits"] else None,
        input_s=inp["total_s"], input_device_bytes=inp["total_bytes"], input_fits=inp["fits"],
        input_host_bytes=inp["host_bytes"],
        input_host_fits=inp["host_bytes"] * hw.gpus_per_node <= hw.host_gb_per_node * GB))
  return out


def offload_on_both_links(hw: Hardware, compiled=None) -> list[dict]:
  """`offload_rows` on `hw`'s host link, then on GH200's NVLink-C2C (`host_link_c2c`)."""
  return [r for link in (hw, host_link_c2c(hw)) for r in offload_rows(link, compiled=compiled)]


def scaling_rows(hardware, models=MODELS, seq_lens=SCALING_SEQ_LENS, block_size: int = 64,
                 strategies=STRATEGIES) -> list[dict]:
  """Strong scaling: one row per (GPU count, model, L, strategy), `hardware` one `Hardware`
  per GPU count (nodes of NVLink, InfiniBand across), each a `project` row (memory assumed)
  with the step split into the busiest rank's compute (`compute_s`: linear layers, logits,
  attention), exposed attention communication (`attention_comm_s`: hops and gathers not
  hidden, waiting for ring neighbours) and the rest (an MoE's token exchange)."""
  out = []
  for hw in hardware:
    rows = project(hw, {"default": Assumptions()}, models, seq_lens, (block_size,),
                   strategies)["default"]
    for r in rows:
      out.append(dict(gpus=hw.num_gpus, nodes=hw.nodes, **r,
                      compute_s=r["linear_s"] + r["attention_busy_s"],
                      attention_comm_s=max(r["attention_s"] - r["attention_busy_s"], 0.0),
                      weights_s=param_traffic_s(models[r["model"]], hw, Assumptions())))
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
  models = list(dict.fromkeys(r["model"] for r in rows))  # in `project`'s order
  keys = sorted({(r["model"], r["seq_len"], r["block_size"]) for r in rows},
                key=lambda k: (models.index(k[0]), k[1], k[2]))
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
