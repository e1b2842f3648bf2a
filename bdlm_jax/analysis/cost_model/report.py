"""The cost model's markdown: its constants, the projection's tables, the paper's claims
next to ours, and the DFlash section. Formatting only: every figure comes from the other
modules."""

import dataclasses

from bdlm_jax.analysis.cost_model import dflash
from bdlm_jax.analysis.cost_model.dflash import (dflash_config, dflash_project, dflash_speedups,
                                                 drafter_params, drafter_s)
from bdlm_jax.analysis.cost_model.hybrid import hybrid_rows
from bdlm_jax.analysis.cost_model.projection import (STRATEGIES, offload_on_both_links, project,
                                                     speedups)
from bdlm_jax.analysis.cost_model.setting import (BLOCK_SIZES, GB, MODELS,
                                                  OFFLOAD_TOLERANCE, SCENARIOS, Assumptions,
                                                  Hardware, h100, host_link_c2c)
from bdlm_jax.analysis.cost_model.timing import hop_s, moe_exchange, param_traffic_s
from bdlm_jax.analysis.cost_model.work import (expert_params, expert_slots, kv_row, moe_layers,
                                               plan_work)
from bdlm_jax.config import ModelConfig
from bdlm_jax.metrics import param_count
from bdlm_jax.models.drafter import drafter_model, target_depth, target_layer_ids
from bdlm_jax.models.pattern import layer_types
from bdlm_jax.parallel.registry import get_strategy, strategy_names

# The two baselines the DFlash reading names: the one that replicates the context (bp) and
# the first ring baseline (cp_ring).
REPLICATED = strategy_names(splits_sequences=True, travels="none")[0]
RING_BASELINE = strategy_names(baseline=True, transport="ring")[0]

# The paper's headline figures (CSBP over the best baseline).
PAPER = (
    dict(claim="SFT", seq_len=256 * 1024, low=1.18, high=1.45, hardware="16x H200"),
    dict(claim="AR->BDLM conversion", seq_len=256 * 1024, low=1.27, high=1.33,
         hardware="16x H200"),
    dict(claim="BDLM training", seq_len=512 * 1024, low=1.61, high=1.61, hardware="16x H200"),
    dict(claim="DFlash2 drafter", seq_len=512 * 1024, low=2.48, high=2.48, hardware="8x H100"),
    dict(claim="DFlash2 drafter", seq_len=1024 * 1024, low=7.59, high=7.59, hardware="8x H100"),
)


def _k(seq_len: int) -> str:
  return f"{seq_len // 1024}K" if seq_len < 1024 * 1024 else f"{seq_len // 1024 ** 2}M"


def _constants(hw: Hardware, a: Assumptions, calibration: str) -> list[str]:
  lines = ["Constants (every one an assumption; change them in `Hardware` / `Assumptions`):", ""]
  lines += [f"* hardware.{f.name} = {getattr(hw, f.name)}" for f in dataclasses.fields(hw)]
  lines += [f"* assumptions.{f.name} = {getattr(a, f.name)}" for f in dataclasses.fields(a)]
  lines += [f"* {calibration}", "* models:"]
  for name, m in MODELS.items():
    if not m.moe_experts:
      lines.append(f"  * {name}: {param_count(m) / 1e9:.2f}B params, d_model {m.d_model}, "
                   f"{m.n_layers} layers ({_layer_kinds(m)}), {m.n_heads} q / "
                   f"{m.n_kv_heads} kv heads x "
                   f"{m.head_dim}, d_ff {m.d_ff}, vocab {m.vocab_size}, tied embeddings "
                   f"{m.tie_embeddings}; ZeRO-3 weight traffic {param_traffic_s(m, hw, a):.1f} "
                   f"s per step, assumed hidden")
      continue
    lines += _moe_lines(name, m, hw, a)
  return lines + [""]


def _layer_kinds(m: ModelConfig) -> str:
  """How many layers of each attention kind, and what a local one sends."""
  kinds = layer_types(m)
  if set(kinds) == {"global"}:
    return "all global attention"
  return (f"{kinds.count('local')} local of window {m.sliding_window}, "
          f"{kinds.count('global')} global; a local layer's pairs are its window's, its K/V "
          f"move by the windowed exchange where that sends fewer rows than the global "
          f"transport, exposed, and its received rows are saved for the backward")


def _moe_lines(name: str, m: ModelConfig, hw: Hardware, a: Assumptions) -> list[str]:
  """An MoE's parameter counts, expert layout and token exchange, as assumed."""
  g, seq_len = hw.num_gpus, 256 * 1024
  rows = 2 * seq_len // g  # noisy and clean rows of one GPU
  pairs, slots = expert_slots(m, rows, g)
  one_way = pairs * m.d_model * a.compute_bytes
  sent, seconds = moe_exchange(m, rows, hw, a)
  return [
      f"  * {name}: {param_count(m) / 1e9:.2f}B params in total (memory: parameters, "
      f"gradients and Adam moments), {param_count(m, active=True) / 1e9:.2f}B active (FLOPs "
      f"and MFU: the router and {m.moe_top_k} of {m.moe_experts} experts of width "
      f"{m.moe_d_ff} per token), d_model {m.d_model}, {m.n_layers} layers "
      f"({_layer_kinds(m)}), every one a "
      f"mixture of experts, {m.n_heads} q / {m.n_kv_heads} kv heads x {m.head_dim}, vocab "
      f"{m.vocab_size}, tied embeddings {m.tie_embeddings}; ZeRO-3 weight traffic of the "
      f"{(param_count(m) - expert_params(m)) / 1e9:.2f}B non-expert params "
      f"{param_traffic_s(m, hw, a):.1f} s per step, assumed hidden",
      f"    * expert parallelism: each layer's experts split over all {g} GPUs "
      f"(`parallel.expert_axes=seq`, {m.moe_experts // g} per GPU, their states never "
      f"gathered), dispatch `ragged_all_to_all`, router balanced; an expert takes at most "
      f"{m.moe_capacity_factor}x its fair share of the group's pairs, so a GPU's experts "
      f"receive into {slots / pairs:.2f}x its own pairs' rows",
      f"    * token exchange per layer and GPU: kept (token, expert) pairs x d_model x "
      f"{a.compute_bytes} B to the experts and as many back, in the forward, the remat's "
      f"forward and the backward (6 exchanges); at L = {_k(seq_len)} {rows} rows x "
      f"{m.moe_top_k} = {pairs} pairs, {one_way / GB:.2f} GB each way, "
      f"{sent / moe_layers(m) / GB:.2f} GB per layer, {sent / GB:.0f} GB per step "
      f"({(g - 1) / g:.0%} leaving the GPU, {max(g - hw.gpus_per_node, 0) / g:.0%} the node), "
      f"{seconds:.1f} s per step, exposed"]


def _strategy_table(rows: list[dict], spd: list[dict]) -> list[str]:
  head = ("| model | L | B | " + " | ".join(STRATEGIES)
          + " | best baseline | CSBP speedup | CSBP MFU |")
  lines = ["Step time in s / peak memory in GB per GPU (one sequence of L tokens over 16 GPUs; "
           "memory compiled by scale_probe where it ran, marked by its compiler: *tpu* "
           "XLA:TPU's own peak, *gpu* XLA:GPU's, *cpu* XLA:CPU's every-buffer bound; else "
           "assumed, *a*; **OOM** = over the usable HBM, excluded from *best*).", "", head,
           "|" + "---|" * (6 + len(STRATEGIES))]
  for s in spd:
    cells = []
    for name in STRATEGIES:
      r = next(r for r in rows if (r["model"], r["seq_len"], r["block_size"], r["strategy"])
               == (s["model"], s["seq_len"], s["block_size"], name))
      oom = "" if r["fits"] else " **OOM**"
      cells.append(f"{r['total_s']:.2f} / {r['memory_bytes'] / GB:.0f} {_source_mark(r)}{oom}")
    speed = "—" if s["speedup"] is None else f"{s['speedup']:.2f}x ({s['csbp']})"
    mfu = "—" if s["csbp_mfu"] is None else f"{s['csbp_mfu']:.0%}"
    lines.append(f"| {s['model']} | {_k(s['seq_len'])} | {s['block_size']} | "
                 + " | ".join(cells) + f" | {s['baseline'] or '—'} | {speed} | {mfu} |")
  return lines + [""]


def _source_mark(row: dict) -> str:
  """*tpu*, *gpu* or *cpu*: the compiler of a row's memory figure; *a*: assumed."""
  compiler = row["memory_source"].split()[0]
  return "*a*" if compiler == "assumed" else f"*{compiler[len('XLA:'):].lower()}*"


def _verdict(row: dict, hw: Hardware) -> str:
  """fits / OOM, with the figure that decided it: 'fits (XLA:TPU peak 37.6 GB of 134)'."""
  return (f"{'fits' if row['fits'] else 'OOM'} ({row['memory_source']} "
          f"{row['memory_bytes'] / GB:.1f} GB "
          f"of {hw.usable_bytes / GB:.0f})")


def _range(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "—"
  lo, hi = min(values), max(values)
  return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def _driver(by_scenario: dict, low: float, high: float, default: list[dict]) -> str:
  """Where the default's speedup comes from, and which single assumption moves it onto the
  paper's figure."""
  def distance(values):  # gap between the projected range and the paper's range
    return max(low - max(values), min(values) - high, 0.0) if values else float("inf")
  if not default:
    return "nothing fits in memory"
  idle = (f"{default[0]['baseline']} spends {max(s['baseline_idle'] for s in default):.0%} of "
          f"its step communicating or waiting, {default[0]['csbp']} "
          f"{max(s['csbp_idle'] for s in default):.0%}")
  if distance(by_scenario["default"]) == 0:
    return f"agrees: {idle}"
  direction = "below" if max(by_scenario["default"]) < low else "above"
  name = min(by_scenario, key=lambda n: distance(by_scenario[n]))
  if name == "default":
    return f"{direction}: {idle}; no single changed assumption comes closer"
  verdict = "reaches it" if distance(by_scenario[name]) == 0 else "comes closest"
  return f"{direction}: {idle}; '{name}' {verdict}"


def _paper_table(results: dict, dflash_spd: list[dict] | None = None) -> list[str]:
  lines = ["| claim | hardware | L | model | paper | " + " | ".join(results)
           + " | what drives it |", "|" + "---|" * (6 + len(results))]
  for claim in PAPER:
    paper = (f"{claim['low']:.2f}x" if claim["low"] == claim["high"]
             else f"{claim['low']:.2f}-{claim['high']:.2f}x")
    head = f"| {claim['claim']} | {claim['hardware']} | {_k(claim['seq_len'])} |"
    if claim["hardware"] != "16x H200":
      at = [s for s in dflash_spd or () if s["seq_len"] == claim["seq_len"]]
      if not at:
        lines.append(f"{head} — | {paper} | " + " | ".join(["not modelled"] * len(results))
                     + " | |")
        continue
      s = at[0]  # the first anchor rule: A = 512
      cells = [f"{_x(s['speedup'])} (vs {s['baseline']}, A = {s['anchors']})"]
      lines.append(f"{head} Qwen3-8B target | {paper} | " + " | ".join(
          cells + ["not run"] * (len(results) - 1))
          + f" | below: the target's forward, {s['target_share']:.0%} of the step, runs "
          f"context-parallel under CP too; CSBP over {REPLICATED} "
          f"{_x(s['over_any'][REPLICATED])} (memory "
          f"ignored); see the DFlash section |")
      continue
    for model in MODELS:
      pick = lambda spd: [s for s in spd if s["seq_len"] == claim["seq_len"]
                          and s["model"] == model and s["speedup"] is not None]
      by = {name: [s["speedup"] for s in pick(spd)] for name, spd in results.items()}
      baselines = sorted({s["baseline"] for s in pick(results["default"])})
      cells = [_range(v) for v in by.values()]
      cells[0] += f" (vs {', '.join(baselines)})" if baselines else ""
      driver = _driver(by, claim["low"], claim["high"], pick(results["default"]))
      lines.append(f"{head} {model} | {paper} | " + " | ".join(cells) + f" | {driver} |")
  return lines + [""]


def _ring_table(rows: list[dict], hw: Hardware, a: Assumptions, block_size: int) -> list[str]:
  """Where ring time goes: busy attention vs wall attention, and one hop vs a mean step."""
  lines = [f"Ring transports at B={block_size}: attention compute of the busiest rank (*busy*) "
           "vs the ring's wall time (*wall*; the difference is waiting for neighbours or "
           "exposed transfers), and one forward K/V hop vs a mean forward ring step.", "",
           "| model | L | strategy | busy s | wall s | hop ms | mean step ms |",
           "|---|---|---|---|---|---|---|"]
  rings = [r for r in rows if r["block_size"] == block_size
           and get_strategy(r["strategy"]).transport == "ring"]
  for r in sorted(rings, key=lambda r: (list(MODELS).index(r["model"]), r["seq_len"],
                                        r["strategy"])):
    m, p = MODELS[r["model"]], hw.num_gpus
    work = plan_work(r["strategy"], r["seq_len"], block_size, p)
    hop = hop_s(work.n_travel * kv_row(m) * a.compute_bytes, hw, p)
    step = (work.travel_pairs.sum(axis=1).mean() / p * 4 * m.n_heads * m.head_dim
            / (hw.attention_tflops * 1e12))
    lines.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['strategy']} | "
                 f"{r['attention_busy_s']:.2f} | {r['attention_s']:.2f} | {hop * 1e3:.1f} | "
                 f"{step * 1e3:.1f} |")
  return lines + [""]


def _memory_table(rows: list[dict], hw: Hardware, probe: str) -> list[str]:
  """The assumed memory next to the compiled one, and where each verdict came from."""
  limit = hw.usable_bytes / GB
  both = [r for r in rows if r["compiled_bytes"]]
  sources = sorted({r["memory_source"] for r in both})
  by = ", ".join(f"{sum(r['memory_source'] == x for r in both)} by {x}" for x in sources)
  lines = [f"Fits / OOM against {limit:.0f} GB usable: {len(both)} of {len(rows)} verdicts "
           f"compiled ({by or 'none'}: the real train step's per-device figure, read from "
           f"{probe}, the first that has the setting; of an MoE its ragged dispatch compiled "
           "with stand-ins; at the probe's block size, and the same figure for the other "
           f"block sizes), the other {len(rows) - len(both)} assumed (this model's "
           "estimate). A compiler's own peak (XLA:TPU, XLA:GPU) is the realistic figure; "
           "XLA:CPU's every-buffer bound overstates it. The time stays the H200 model's. "
           "Below: the probed settings.", ""]
  if not both:
    return lines + ["No compiled figures: run `experiments/scale_probe.py` (16 devices, "
                    "block size 64, full depth) for compiled verdicts.", ""]
  lines += ["| model | L | B | strategy | assumed GB | compiled GB | assumed ÷ compiled | "
            "verdict |", "|---|---|---|---|---|---|---|---|"]
  for r in (r for r in both if r["compiled_here"]):
    lines.append(f"| {r['model']} | {_k(r['seq_len'])} | {r['block_size']} | {r['strategy']} | "
                 f"{r['total_bytes'] / GB:.1f} | {r['compiled_bytes'] / GB:.1f} | "
                 f"{r['total_bytes'] / r['compiled_bytes']:.3f} | {_verdict(r, hw)} |")
  return lines + [""]


def _offload_section(hw: Hardware, rows: list[dict]) -> list[str]:
  """remat=full next to remat=offload per (model, L, strategy), on the default host link and
  on GH200's NVLink-C2C (`offload_on_both_links(hw)`)."""
  pcie = [r for r in rows if r["host_gb_s"] == hw.host_gb_s]
  c2c = {(r["model"], r["seq_len"], r["strategy"]): r for r in rows
         if r["host_gb_s"] == host_link_c2c(hw).host_gb_s}
  block = pcie[0]["block_size"]
  lines = [f"### Host-offloaded residuals (`model.remat=offload`, B={block})", "",
           "Under `offload` each layer's saved residuals (what `full` keeps on the GPU: the "
           "layer input with its row metadata, the attention core's output and LSE, a local "
           "layer's exchanged K/V) go to host memory once in the forward and come back once "
           f"in the backward, over the host link at {hw.host_gb_s:g} GB/s per direction "
           "(`hardware.host_gb_s`, PCIe Gen5 x16, an assumption) or "
           f"{host_link_c2c(hw).host_gb_s:g} GB/s (GH200's NVLink-C2C, a scenario). A copy "
           "runs beside its own layer's linear and attention time; only what outlasts it is "
           "*exposed* and adds to the step. *full*: time / memory as in the table above "
           "(compiled where probed); *offload*: its device memory assumed (states, the "
           "largest transient, two layers' residuals in flight), its host memory per GPU "
           f"(**over** where a node's {hw.gpus_per_node} GPUs need more than its "
           f"{hw.host_gb_per_node:g} GB). *copied*: both directions per step. "
           "*offload_input*: `model.remat=offload_input`, the layer input alone in host "
           "memory (about half the bytes), each layer's attention forward and its K/V "
           "transport run again in the backward: step s / device GB / host GB per GPU.", "",
           "| model | L | strategy | full s / GB | offload s / GB | host GB per GPU | copied GB "
           "| copy s | exposed s (PCIe / C2C) | offload ÷ full | offload_input s / GB / host GB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in pcie:
    over = "" if r["host_fits"] else " **over**"
    oom = lambda fits: "" if fits else " **OOM**"
    within = ("" if r["within_tolerance"] is None else
              f" (within {OFFLOAD_TOLERANCE:.0%})" if r["within_tolerance"]
              else f" **(over {OFFLOAD_TOLERANCE:.0%})**")
    lines.append(
        f"| {r['model']} | {_k(r['seq_len'])} | {r['strategy']} | {r['full_s']:.2f} / "
        f"{r['full_memory_bytes'] / GB:.0f}{oom(r['full_fits'])} | {r['offload_s']:.2f} / "
        f"{r['offload_device_bytes'] / GB:.0f}{oom(r['offload_fits'])} | "
        f"{r['host_bytes'] / GB:.1f}{over} | {r['host_bytes_per_step'] / GB:.0f} | "
        f"{r['host_copy_s']:.2f} | {r['host_exposed_s']:.2f} / "
        f"{c2c[(r['model'], r['seq_len'], r['strategy'])]['host_exposed_s']:.2f} | "
        f"{r['slowdown']:.3f}{within} | {r['input_s']:.2f} / "
        f"{r['input_device_bytes'] / GB:.0f}{oom(r['input_fits'])} / "
        f"{r['input_host_bytes'] / GB:.1f}{'' if r['input_host_fits'] else ' **over**'} |")
  return lines + ["", _offload_reading(pcie, hw), ""]


def _offload_reading(rows: list[dict], hw: Hardware) -> str:
  """What the host link's assumption does to the step."""
  fit = [r for r in rows if r["full_fits"]]
  within = sum(bool(r["within_tolerance"]) for r in fit)
  worst = max(rows, key=lambda r: r["host_exposed_s"] / r["full_s"])
  ratio = max(r["host_copy_s"] / r["full_s"] for r in rows)
  usable = hw.usable_bytes
  rescued = lambda full: sum(full(r) > usable and r["offload_fits"] and r["host_fits"]
                             for r in rows)
  most = (f"most exposed: {worst['model']} {_k(worst['seq_len'])} {worst['strategy']}, "
          f"{worst['host_exposed_s']:.2f} s of {worst['offload_s']:.2f}"
          if worst["host_exposed_s"] else "none exposed")
  return (f"**Reading.** At {hw.host_gb_s:g} GB/s the copies take at most {ratio:.1%} of a "
          f"step, and hide under their layers in {sum(r['host_exposed_s'] == 0 for r in rows)}"
          f" of {len(rows)} settings ({most}); "
          f"where `full` fits, `offload` stays within {OFFLOAD_TOLERANCE:.0%} of it in {within} "
          f"of {len(fit)}. Offload's device memory (assumed) and host memory fit "
          f"{rescued(lambda r: r['full_assumed_bytes'])} settings where full's assumed memory "
          f"does not ({rescued(lambda r: r['full_memory_bytes'])} beside full's figures above, "
          "compiled where probed).")


def scaling_report(rows: list[dict]) -> str:
  """The markdown of the strong-scaling sweep (`scaling_rows`): per strategy the step and its
  split into compute and exposed attention communication, and CSBP over the best fitting
  baseline."""
  gpus = sorted({r["gpus"] for r in rows})
  spd = [dict(gpus=g, **s) for g in gpus for s in speedups([r for r in rows if r["gpus"] == g])]
  at = {(r["gpus"], r["model"], r["seq_len"], r["strategy"]): r for r in rows}
  models = list(dict.fromkeys(r["model"] for r in rows))
  strategies = list(dict.fromkeys(r["strategy"] for r in rows))
  lines = [f"## Cost model: strong scaling ({gpus[0]}-{gpus[-1]} H200)", "",
           "Produced by `experiments/cost_model.py --scaling`: one sequence of fixed L over "
           f"{', '.join(map(str, gpus))} GPUs, 8 a node (NVLink inside a node, InfiniBand "
           "across: a ring or gather that leaves the node runs at InfiniBand's pace), B = "
           f"{rows[0]['block_size']}, the default scenario and constants of the 16-GPU "
           "projection. Cell: step s (busiest rank's compute + exposed attention "
           "communication: hops and gathers not hidden, waiting for ring neighbours; an "
           "MoE's token exchange is the rest). **OOM**: over the usable HBM by the assumed "
           "memory (no compiled figures here). *weights*: ZeRO-3's weight traffic per "
           "step, assumed hidden under the linear layers.", "",
           "| model | L | GPUs | " + " | ".join(strategies)
           + " | best baseline | CSBP speedup | weights s |",
           "|" + "---|" * (6 + len(strategies))]
  for s in sorted(spd, key=lambda s: (models.index(s["model"]), s["seq_len"], s["gpus"])):
    cells = []
    for name in strategies:
      r = at[(s["gpus"], s["model"], s["seq_len"], name)]
      cells.append(f"{r['total_s']:.2f} ({r['compute_s']:.2f} + {r['attention_comm_s']:.2f})"
                   + ("" if r["fits"] else " **OOM**"))
    speed = "—" if s["speedup"] is None else f"{s['speedup']:.2f}x ({s['csbp']})"
    weights = at[(s["gpus"], s["model"], s["seq_len"], strategies[0])]["weights_s"]
    lines.append(f"| {s['model']} | {_k(s['seq_len'])} | {s['gpus']} | " + " | ".join(cells)
                 + f" | {s['baseline'] or '—'} | {speed} | {weights:.2f} |")
  lines += ["", "**Reading.** CSBP over the best fitting baseline as the GPUs grow, and that "
            "baseline's exposed attention communication as a share of its step:", ""]
  for model in models:
    for seq_len in sorted({r["seq_len"] for r in rows}):
      path = [s for s in spd if (s["model"], s["seq_len"]) == (model, seq_len)]
      steps = []
      for s in sorted(path, key=lambda s: s["gpus"]):
        if s["speedup"] is None:
          steps.append(f"{s['gpus']}: —")
          continue
        base = at[(s["gpus"], model, seq_len, s["baseline"])]
        steps.append(f"{s['gpus']}: {s['speedup']:.2f}x ({s['baseline']} "
                     f"{base['attention_comm_s'] / base['total_s']:.0%})")
      csbp = lambda s: at[(s["gpus"], model, seq_len, s["csbp"])]
      unhidden = [s["gpus"] for s in path
                  if s["csbp"] and csbp(s)["weights_s"] > csbp(s)["linear_s"]]
      caveat = (f"; ZeRO-3's weight traffic outlasts CSBP's linear layers (under which it "
                f"is assumed hidden) from {min(unhidden)} GPUs" if unhidden else "")
      lines.append(f"* {model} at {_k(seq_len)}: " + ", ".join(steps) + caveat)
  return "\n".join(lines + [""])


def _dflash_paper(spd: list[dict]) -> dict:
  """{L: (paper's figure, this model's rows at that L)} for the DFlash claims."""
  return {c["seq_len"]: (c["low"], [s for s in spd if s["seq_len"] == c["seq_len"]])
          for c in PAPER if c["hardware"] == "8x H100"}


def _x(value) -> str:
  return "—" if value is None else f"{value:.2f}x"


def _dflash_section(hw: Hardware, a: Assumptions, rows: list[dict], spd: list[dict]) -> list[str]:
  """The drafter-training projection: its assumptions, a row per strategy, the paper's claims."""
  cfg = dflash_config(dflash.SEQ_LENS[0], 512)
  m, d = cfg.model, drafter_model(cfg)
  g, e = hw.num_gpus, a.compute_bytes
  ids = target_layer_ids(cfg)
  n_draft = drafter_params(cfg)
  zero3 = (param_count(m) * e + n_draft * (2 * e + 4)) * (g - 1) / g / (hw.nvlink_gb_s * GB)
  lines = [
      f"### DFlash drafter training ({hw.num_gpus}x H100, one node)", "",
      "One sequence of L tokens per step over the 8 GPUs (docs/dflash.md): the frozen "
      "target runs a causal forward over the L context rows (no backward) and hands 5 of its "
      "layers' outputs to the drafter, which trains forward + backward over A draft blocks of "
      "B rows. Work per GPU from the real drafter plans (`make_plan(..., draft_blocks=A)`), "
      "the target's from the context zigzag its rows already sit on; time and transports as "
      "above (ring hops hidden under each step's compute, all-gathers exposed). Assumptions:",
      "",
      f"* hardware: {hw.name}; peak {hw.peak_tflops} TFLOP/s bf16, GEMMs at "
      f"{hw.matmul_tflops}, attention at {hw.attention_tflops:.1f} (the H200's rates: same "
      f"GH100 compute), NVLink {hw.nvlink_gb_s} GB/s one way per GPU + {hw.nvlink_alpha_us} us "
      f"per hop, {hw.hbm_gb:.0f} GB HBM of which {hw.usable_fraction:.0%} usable "
      f"({hw.hbm_gb * hw.usable_fraction:.0f} GB)",
      f"* target (frozen): Qwen3-8B, {param_count(m) / 1e9:.2f}B params, {m.n_layers} layers, "
      f"d_model {m.d_model}, {m.n_heads} q / {m.n_kv_heads} kv heads x {m.head_dim}, d_ff "
      f"{m.d_ff}, vocab {m.vocab_size}; bf16 weights ZeRO-3 over the {g} GPUs "
      f"({param_count(m) * e / g / GB:.1f} GB each, two layers gathered at a time), no grads, "
      f"no optimiser state; forward only over its first {target_depth(cfg)} layers (up to the "
      f"last chosen one), nothing saved but the outputs of layers {ids} "
      f"([context rows, {len(ids) + 1}, {m.d_model}] bf16: `Transformer.features` keeps a spare "
      f"slot); a layer's projections and MLP run over all of a GPU's context rows at once "
      f"(no row chunking); its causal attention is timed at the fwd+bwd attention rate (a "
      f"forward alone runs faster: this overstates the target's seconds, alike for every "
      f"strategy)",
      f"* drafter (trained): {d.n_layers} layers of the target's width and heads, d_ff {d.d_ff}, "
      f"B = {dflash.BLOCK}; fc {len(ids) * m.d_model} -> {d.d_model} + RMSNorm over the context "
      f"rows, then each layer's own k/v projections of them; {n_draft / 1e9:.2f}B params with "
      f"f32 grads and Adam moments ({a.state_bytes_per_param} B/param), ZeRO-3 over the {g} "
      f"GPUs ({n_draft * a.state_bytes_per_param / g / GB:.1f} GB each); full remat (each "
      f"layer's linear forward, context k/v included, runs again in the backward); logits of "
      f"the draft rows only, through the target's frozen LM head in chunks of "
      f"{m.logits_chunk} rows",
      "* anchors A per sequence: 512, as SpecForge's DFlash recipe for Qwen3-8B draws per "
      "(3K-token) sequence; at 512K-1M that is one anchor per 1-2K tokens, and the drafter's "
      "share of the step is small. A = L/64 (a quarter of the rows drafted) shows how the "
      "projection moves with A. Anchor j sits at its expected place (j+1)L/(A+1) "
      "(`LayoutPlan.block_starts`), blocks balanced as the plans place them",
      "* what moves per GPU: cp_* the target's context K/V (forward only) and, per drafter "
      "layer, the draft + context K/V forward and their f32 dK/dV back; csbp_* the same "
      "target traffic and only the context K/V (and grads) of the drafter; bp nothing (every "
      "GPU runs the target over the whole context: P-fold compute, O(L) memory); ring "
      "overlap, tile skipping, K/V metadata as in the default scenario",
      f"* ZeRO-3 weight traffic per step (target gathered once in bf16, drafter gathered "
      f"twice, its grads reduce-scattered in f32): {zero3:.2f} s on NVLink, assumed hidden",
      f"* `none` = data parallel, one whole sequence per GPU: its time per sequence is one "
      f"GPU's step / {g}; a reference, not one of the baselines (cp_*, bp)",
      "",
      f"Time per sequence in s ({g} GPUs), its speedup over the best fitting baseline, assumed "
      "peak memory per GPU (**OOM** over the usable HBM, excluded from *best*), the target's "
      "and the drafter's seconds of one step (under `none`, a GPU's step over its own "
      "sequence), attention bytes each GPU sends per step, the largest part of the step "
      "(*transfer/wait*: exposed transfers and waiting for ring neighbours), MFU.",
      "",
      "| L | A | strategy | s / sequence | vs best baseline | GB / GPU | target s | drafter s | "
      "sent GB | dominant cost | MFU |", "|" + "---|" * 11]
  best = {(s["seq_len"], s["anchor_rule"]): s for s in spd}
  for r in rows:
    s = best[(r["seq_len"], r["anchor_rule"])]
    base = next((x for x in rows if (x["seq_len"], x["anchor_rule"], x["strategy"])
                 == (r["seq_len"], r["anchor_rule"], s["baseline"])), None)
    vs = _x(base["seq_s"] / r["seq_s"]) if base and r["fits"] else "—"
    oom = "" if r["fits"] else " **OOM**"
    target_s = r["target_linear_s"] + r["target_attention_s"]
    lines.append(f"| {_k(r['seq_len'])} | {r['anchors']} | {r['strategy']} | {r['seq_s']:.2f} | "
                 f"{vs} | {r['total_bytes'] / GB:.0f}{oom} | {target_s:.2f} | "
                 f"{drafter_s(r):.2f} | {r['comm_bytes_per_step'] / GB:.0f} | {r['dominant']} | "
                 f"{r['mfu']:.0%} |")
  lines += ["", "CSBP over each baseline, also where it does not fit (memory ignored), and over "
            "the drafter's part alone (were the target's features given, e.g. precomputed):", "",
            "| L | A | best fitting baseline | CSBP speedup | over "
            + " / ".join(spd[0]["over_any"]) + ", memory ignored | drafter part only, over "
            + " / ".join(spd[0]["drafter_only"]) + " | target share of CSBP's step |",
            "|---|---|---|---|---|---|---|"]
  for s in spd:
    lines.append(f"| {_k(s['seq_len'])} | {s['anchors']} | {s['baseline'] or '—'} | "
                 f"{_x(s['speedup'])} ({s['csbp'] or '—'}) | "
                 + " / ".join(_x(v) for v in s["over_any"].values()) + " | "
                 + " / ".join(_x(v) for v in s["drafter_only"].values())
                 + f" | {s['target_share']:.0%} |")
  lines += ["", "Next to the paper (DFlash training, CSBP over the best baseline on 8 H100):", "",
            "| L | paper | ours, A = 512 | ours, A = L/64 | CSBP over bp, memory ignored | "
            "drafter part only, over bp |", "|---|---|---|---|---|---|"]
  for seq_len, (paper, at) in _dflash_paper(spd).items():
    ours = [_x(s["speedup"]) + f" (vs {s['baseline']})" for s in at]
    lines.append(f"| {_k(seq_len)} | {paper:.2f}x | " + " | ".join(ours) + " | "
                 + ", ".join(_x(s["over_any"][REPLICATED]) for s in at) + " | "
                 + ", ".join(_x(s["drafter_only"][REPLICATED]) for s in at) + " |")
  lines += ["", _dflash_reading(spd, rows, hw), ""]
  return lines


def _dflash_reading(spd: list[dict], rows: list[dict], hw: Hardware) -> str:
  """What the projection says next to the paper's figures, and what would have to change."""
  paper = _dflash_paper(spd)
  lo, hi = min(paper), max(paper)
  by_a = lambda key, seq_len: ", ".join(f"{_x(s[key][REPLICATED])} at A = {s['anchors']}"
                                        for s in spd if s["seq_len"] == seq_len)
  fitting = [s["speedup"] for s in spd if s["speedup"] is not None]
  reached = any(abs(s["speedup"] - p) <= 0.1 * p for p, at in paper.values() for s in at
                if s["speedup"] is not None)
  fits = lambda name: any(r["fits"] for r in rows if r["strategy"] == name)
  bp_gb = [r["total_bytes"] / GB for r in rows if r["strategy"] == REPLICATED]
  return (
      f"**Reading.** Our projection {'reaches' if reached else 'does not reach'} the paper's "
      f"figures: CSBP over the best fitting baseline is {_range(fitting)}, over cp_ring "
      f"{_range([s['over_any'][RING_BASELINE] for s in spd])}. The frozen target's causal "
      f"forward is {min(s['target_share'] for s in spd):.0%} or more of CSBP's step, and CP "
      f"runs it context-parallel on the same zigzag shards (its K/V hops hide under each ring "
      f"step's compute); the two differ only in the drafter, where CP also moves the A*B/P "
      f"draft rows' K/V beside the L/P context rows'. bp repeats the target's O(L^2) forward "
      f"on all {hw.num_gpus} GPUs: CSBP is {_range([s['over_any'][REPLICATED] for s in spd])} "
      f"faster, but bp needs {min(bp_gb):.0f}-{max(bp_gb):.0f} GB per GPU "
      f"({'fits' if fits(REPLICATED) else 'OOM'} on {hw.hbm_gb:.0f} GB). For the paper's figures "
      f"the best baseline would have to be bp-like (a CP baseline that does not run the "
      f"target context-parallel, and fits): the {_k(hi)} figure, {paper[hi][0]:.2f}x, is "
      f"near our CSBP over bp, memory ignored ({by_a('over_any', hi)}); the {_k(lo)} one, "
      f"{paper[lo][0]:.2f}x, is near only the drafter's part over bp ({by_a('drafter_only', lo)};"
      f" a step whose target features are given), which stays there at {_k(hi)} "
      f"({by_a('drafter_only', hi)}). No single changed assumption gives both. Data "
      f"parallelism (`none`, one sequence per GPU) would take "
      f"{_range([s['over_any']['none'] for s in spd])} CSBP's time per sequence were a whole "
      f"sequence to fit one GPU; "
      + ("it does at some of these lengths." if fits("none")
         else "it does not at these lengths."))


def _csbp_over_paper(c: dict) -> str:
  """The first cells of a `paper_comparison` row: recipe, L, CSBP and the paper's baseline
  per sequence (fed / compute), and CSBP's speedup over it."""
  csbp, paper = c["csbp"], c["paper"]
  return (f"| {c['recipe']} | {_k(c['seq_len'])} | {csbp['seq_s']:.3f} / "
          f"{csbp['seq_compute_s']:.3f} ({csbp['strategy']}) | {paper['seq_s']:.3f} / "
          f"{paper['seq_compute_s']:.3f} | {_x(c['over_paper'])} / "
          f"{_x(c['over_paper_compute'])} |")


def dflash2_section(hw: Hardware, rows: list[dict], seed_rows: list[dict]) -> list[str]:
  """The DFlash2 recipes (features from disk) next to the paper's 8 H100 figures: CSBP over
  the paper's baseline and over our best fitting one, fed from disk and compute alone, as
  this package runs them (`rows`) and under the seed's settings (`seed_rows`)."""
  figure = {seq_len: paper for seq_len, (paper, _) in _dflash_paper(
      [dict(seq_len=r["seq_len"]) for r in rows]).items()}
  bp = dflash.CONTEXT_REPLICATED
  lines = [f"### DFlash2 recipes, features from disk ({hw.name})", "",
           f"Seconds per sequence (the node's step over the sequences it trains at once) and "
           f"CSBP's speedup, *fed*: the step with its features read from NVMe "
           f"({hw.disk_gb_s:.0f} GB/s a node, prefetched) and copied to each GPU "
           f"({hw.host_gb_s:.0f} GB/s); *compute*: the features already on the GPU. "
           f"Paper baseline = {dflash.PAPER_BASELINE} (every draft block on every rank); ours "
           f"= the best fitting of cp_*, {bp}.", "",
           f"As this package runs them ({dflash.OURS.name}: one sequence over the 8 GPUs, "
           f"full remat, f32 weights and Adam state, each GPU's feature copy in the step):", "",
           "| recipe | L | CSBP s (fed / compute) | paper baseline s | over it (fed / compute) "
           "| paper's figure | our best baseline | over it (fed / compute) | OOM |",
           "|" + "---|" * 9]
  for c in dflash.paper_comparison(rows):
    ours = c["ours_compute"]
    lines.append(
        f"{_csbp_over_paper(c)} {_x(figure.get(c['seq_len']))} | {ours['strategy']} "
        f"{ours['seq_compute_s']:.3f} | {_x(c['over_ours'])} / {_x(c['over_ours_compute'])} | "
        f"{', '.join(c['oom']) or '—'} |")
  lines += ["", f"Under {dflash.SEED.name} settings (its recipe: CP 4 / BP 4, two sequences at "
            f"once on the 8 GPUs; no activation checkpointing; bf16 weights and Adam state; the "
            f"feature copy prefetched a batch ahead), CSBP against the paper's candidate "
            f"baselines on all 8 GPUs, one sequence at a time, with the same settings: "
            f"{dflash.PAPER_BASELINE} (CP 8, BP 1) and {bp} (BP 8):", "",
            f"| recipe | L | CSBP s (fed / compute) | CP 8 all blocks s (fed / compute) | over it "
            f"(fed / compute) | {bp} s (fed / compute) | over it (fed / compute) | paper's "
            f"figure | OOM |", "|" + "---|" * 9]
  for c in dflash.paper_comparison(seed_rows):
    csbp, base = c["csbp"], next(r for r in seed_rows if (
        r["recipe"], r["seq_len"], r["strategy"]) == (c["recipe"], c["seq_len"], bp))
    lines.append(
        f"{_csbp_over_paper(c)} {base['seq_s']:.3f} / {base['seq_compute_s']:.3f} | "
        f"{_x(base['seq_s'] / csbp['seq_s'])} / "
        f"{_x(base['seq_compute_s'] / csbp['seq_compute_s'])} | "
        f"{_x(figure.get(c['seq_len']))} | {', '.join(c['oom']) or '—'} |")
  return lines + [""]


def hybrid_section(hw: Hardware, rows: list[dict]) -> list[str]:
  """The Gated DeltaNet hybrid at the seed's conversion setting (`hybrid.hybrid_rows`): our
  chain under csbp_ring and cp_ring, and the seed's head-parallel GDN."""
  r0 = rows[0]
  lines = [f"### Gated DeltaNet hybrid: {r0['model']}, {r0['objective']}, L = "
           f"{_k(r0['seq_len'])}, B = {r0['block_size']} ({hw.name})", "",
           "One step (both complementary copies) under full remat. *chain*: this package's "
           "GDN program (segments, a chain of one-state hops, tails all-gathered, copies "
           "fetched where blocks live elsewhere); *seed all-to-all*: the seed's head-parallel "
           "GDN (q, k, v, z, b, a to head shards and back, boundary states to each block's "
           "rank), with csbp_ring's attention. GDN s: the GDN layers' conv and delta rule at "
           f"{hw.delta_rule_tflops:g} TFLOP/s plus what they wait for (*wait*), the "
           "projections being timed with the linear layers. Sent: GB each rank sends a step "
           "(the chain's hops at their one sender, averaged over ranks). State: f32 GDN "
           "states one layer keeps for its backward (one copy).", "",
           "| strategy | GDN | step s | csbp_ring + chain faster by | attention s | GDN s "
           "(wait) | attention GB sent | GDN GB sent | GDN state MiB / layer |",
           "|" + "---|" * 9]
  for r in rows:
    name = "chain" if r["gdn_transport"] == "chain" else "seed all-to-all"
    lines.append(f"| {r['strategy']} | {name} | {r['total_s']:.2f} | {_x(r['csbp_speedup'])} | "
                 f"{r['attention_s']:.2f} | {r['gdn_s']:.2f} ({r['gdn_wait_s']:.2f}) | "
                 f"{r['attention_bytes_per_step'] / GB:.1f} | "
                 f"{r['gdn_bytes_per_step'] / GB:.1f} | {r['gdn_state_bytes'] / 2 ** 20:.0f} |")
  return lines + [""]


def report(hw: Hardware, calibration: str, compiled=None, probe: str = "`scale_probe.csv`",
           dflash_rows: list[dict] | None = None,
           offload: list[dict] | None = None,
           dflash2_rows: list[dict] | None = None,
           gdn_rows: list[dict] | None = None,
           dflash2_seed_rows: list[dict] | None = None) -> tuple[str, list[dict]]:
  """(markdown, the default scenario's rows). `dflash_rows`: `dflash_project` rows on
  `h100(hw)`; `offload`: `offload_on_both_links(hw, compiled)`; `dflash2_rows`:
  `dflash2_project` rows on `h100(hw)`; `gdn_rows`: `hybrid_rows(hw)`; `dflash2_seed_rows`:
  `dflash2_seed_project` rows on `h100(hw)` (each projected here when not given)."""
  if dflash_rows is None:
    dflash_rows = dflash_project(h100(hw), SCENARIOS["default"])
  if dflash2_rows is None:
    dflash2_rows = dflash.dflash2_project(h100(hw), SCENARIOS["default"])
  if dflash2_seed_rows is None:
    dflash2_seed_rows = dflash.dflash2_seed_project(h100(hw), SCENARIOS["default"])
  if offload is None:
    offload = offload_on_both_links(hw, compiled)
  if gdn_rows is None:
    gdn_rows = hybrid_rows(hw)
  dflash_spd = dflash_speedups(dflash_rows)
  rows_by = project(hw, SCENARIOS, compiled=compiled)
  results = {name: speedups(rows) for name, rows in rows_by.items()}
  default = SCENARIOS["default"]
  lines = ["## Cost model: projected step time and memory (16 H200)", "",
           "Produced by `experiments/cost_model.py`: an analytical model, not a measurement. "
           "Work per rank comes from the strategies' real layout plans; time from achieved "
           "TFLOP/s and an alpha-beta network; memory from the compiled train step where "
           "`experiments/scale_probe.py` compiled it (the most realistic compiler's figure, "
           "each verdict naming it), else assumed from states, saved "
           "activations and the largest transient. CSBP speedup = best fitting baseline "
           "(cp_ring, cp_allgather, bp) over the best fitting CSBP transport.", ""]
  lines += _constants(hw, default, calibration)
  lines += ["### Default scenario (tile skipping, ring overlap)", ""]
  lines += _strategy_table(rows_by["default"], results["default"])
  lines += ["### Memory: assumed vs compiled", ""]
  lines += _memory_table(rows_by["default"], hw, probe)
  lines += _ring_table(rows_by["default"], hw, default, 64)
  lines += _offload_section(hw, offload)
  lines += ["### Projection next to the paper", "",
            "Ranges run over each model's block sizes " + ", ".join(map(str, BLOCK_SIZES))
            + ". Scenarios change one assumption: *balanced ring steps* gives every rank its "
            "mean ring-step time (what a CP layout balanced per step, not only per rank, "
            "would get); *no ring overlap* exposes every ring hop; "
            "*no tile skipping* makes the kernel compute every pair of each K/V visit that has "
            "any allowed pair (as the `xla` kernel and mask-unaware flash kernels do). SFT and "
            "AR->BDLM conversion train the same [x_t; x_0] stream, so the plans (and this "
            "model) do not tell them apart. The block size barely moves the projection: "
            "allowed pairs are L(L+B) and every plan balances at these B; where B matters "
            "on a GPU is tile waste around B x B diagonal blocks, which this model ignores.",
            ""]
  lines += _paper_table(results, dflash_spd)
  lines += _dflash_section(h100(hw), default, dflash_rows, dflash_spd)
  lines += dflash2_section(h100(hw), dflash2_rows, dflash2_seed_rows)
  lines += hybrid_section(hw, gdn_rows)
  return "\n".join(lines), rows_by["default"]

