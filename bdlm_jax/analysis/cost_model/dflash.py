"""DFlash drafter training (docs/dflash.md) on one node of 8 H100.

A Qwen3-8B target, frozen, runs a causal forward over the L context rows; a 5-layer drafter
trains over A draft blocks. The drafter's work comes from its real plans (`make_plan(...,
draft_blocks=A)`), the target's from the context zigzag its rows sit on (`context_work`:
context parallel where K/V travel, the whole context on every GPU under bp); useful FLOPs are
`model_flops_per_step` of the dflash config.
"""

import dataclasses

import numpy as np

from bdlm_jax.analysis.cost_model.projection import BASELINES, CSBP
from bdlm_jax.analysis.cost_model.setting import GB, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.timing import attention_s
from bdlm_jax.analysis.cost_model.work import (PlanWork, context_work, distinct_plans, kv_row,
                                               work_of)
from bdlm_jax.analysis.hlo_stats import COLLECTIVE_KINDS, wire_bytes
from bdlm_jax.analysis.step_report import attention_traffic, context_traffic
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.metrics import linear_flops_per_row, model_flops_per_step, param_count
from bdlm_jax.models.drafter import drafter_model, target_depth, target_layer_ids
from bdlm_jax.parallel.registry import SINGLE_DEVICE, drafter_plan, get_strategy, strategy_names

# Qwen3-8B as the frozen target, DFlash's Qwen3-8B drafter (5 layers of the target's width
# and heads, d_ff 12288, blocks of 16; its context: 5 target layers' outputs -> fc -> RMSNorm).
TARGET = ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                     head_dim=128, d_ff=12288, rope_theta=1e6, qk_norm=True,
                     tie_embeddings=False, compute_dtype="bfloat16")
DRAFT_LAYERS = 5
BLOCK = 16
SEQ_LENS = (512 * 1024, 1024 * 1024)
# Anchors per sequence: SpecForge's DFlash recipe for Qwen3-8B draws 512 (at 3K tokens); the
# same 512 at 512K-1M is one anchor per 1-2K tokens. A = L/64 (a quarter of the rows drafted)
# is the sensitivity row: the drafter's own share of the step grows with A.
ANCHORS = (("512 (SpecForge recipe)", lambda seq_len: 512),
           ("L/64 (sensitivity)", lambda seq_len: seq_len // 64))


# The seed paper's baseline: every draft block on every rank (its `all_blocks` mode)
PAPER_BASELINE = strategy_names(needs_drafter=True, baseline=True)[0]
# The context on every rank, the draft blocks split (bp): the paper's other candidate
CONTEXT_REPLICATED = strategy_names(splits_sequences=True, travels="none")[0]
# Context pruning's K/V packets: padded to the largest owner's kept rows, in tiles of 256
# rows (the seed's `compact_dflash_target_context`, model.py ~1053-1213)
PRUNED_TILE = 256
FEATURE_BYTES = 2  # the features are stored and copied in bf16 (the recipes' `dtype: bf16`)


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """How a DFlash2 recipe's step runs, beyond its model and strategy: this package's config
  (`OURS`) or the seed's recipe files and trainer (`SEED`)."""
  name: str
  # data-parallel groups the node's GPUs form, each splitting its own sequence (the seed's
  # CP 4 / BP 4 on 8 GPUs: 2 groups of 4)
  sequence_groups: int
  remat_forward: int  # activation checkpointing re-runs each drafter layer's forward (1), or not
  state_bytes_per_param: int  # f32 weights, grads and Adam moments (16), or all bf16 (8)
  prefetch_copy: bool  # each GPU's copy of its features runs a batch ahead, off the step


OURS = RunSettings("ours", sequence_groups=1, remat_forward=1, state_bytes_per_param=16,
                   prefetch_copy=False)
# The seed's Muse recipe (recipes/runs/dflash2-muse-glimmer-30b-1m.yaml): CP 4 / BP 4 on 8 GPUs
# (2 data-parallel groups, core/parallel/runtime.py ~988-989), `activation_checkpointing:
# false`, bf16 weights under fused AdamW (dflash/executor.py ~256), the feature copy
# prefetched one batch ahead on a side stream (dflash/data.py ~325-339, ~505-522).
SEED = RunSettings("the seed's", sequence_groups=2, remat_forward=0, state_bytes_per_param=8,
                   prefetch_copy=True)


@dataclasses.dataclass(frozen=True)
class Dflash2Recipe:
  """A DFlash2 recipe of the seed (Turbo-dLLM 0.1.6, `recipes/runs/dflash2-*-1m.yaml`): a
  drafter of every-layer sliding-window attention over target features read from disk
  (`target_features: offline`); locality anchors; 1M tokens on 8 H100."""
  target: ModelConfig  # the verifier: its width, vocabulary and head (the features' width)
  drafter: dict  # drafter.* (layers, widths, window, the target layers read)
  block_size: int
  anchors: int


DFLASH2_RECIPES = {
    # Muse-Glimmer-30B-DFlash2 (the seed's recipe, Turbo-dLLM 0.1.6
    # recipes/runs/dflash2-muse-glimmer-30b-1m.yaml: B 16, 512 anchors, canonical layer ids
    # [2, 14, 26, 38, 50], the outputs of layers 1, 13, 25, 37, 49); widths as
    # configs/dflash2_muse_1m.py gives them: 5 layers, all
    # sliding, W 2048, H 6656, I 19968, 32 / 8 heads x 128, vocabulary 202,048, fc 33,280 ->
    # 6,656 (5 target layers of width 6656), rope 5e5. The verifier's depth only needs
    # to reach layer 49; its own d_ff is unused (its layers never run). Draft blocks causal
    # on the sliding layers, the seed's default (as the config: its docstring says why).
    "muse-glimmer-30b": Dflash2Recipe(
        ModelConfig(vocab_size=202048, d_model=6656, n_layers=50, n_heads=32, n_kv_heads=8,
                    head_dim=128, d_ff=19968, rope_theta=5e5, qk_norm=True,
                    tie_embeddings=False, compute_dtype="bfloat16"),
        dict(n_layers=5, d_ff=19968, window=2048, target_layers="1,13,25,37,49",
             features="offline", sliding_causal=True), block_size=16, anchors=512),
    # Qwen3.8-27B-DFlash2 (recipe: B 8, 2048 anchors, canonical layer ids [6, 20, 34, 48, 62],
    # the outputs of layers 5, 19, 33, 47, 61; W 2048: its
    # ~18.4K kept rows of 1M are 2048 anchors x stride 8 + W). The verifier's dims are not in
    # the seed (loaded from its Hugging Face config): ASSUMED Qwen3.5-27B-class, width 5120,
    # 64 layers (configs/qwen3_5_27b_fast_dllm_v2_256k.py), 24 / 4 heads x 256, d_ff 17408,
    # vocabulary 248,320; the drafter 5 layers of that width, as the Muse one.
    "qwen3.8-27b": Dflash2Recipe(
        ModelConfig(vocab_size=248320, d_model=5120, n_layers=64, n_heads=24, n_kv_heads=4,
                    head_dim=256, d_ff=17408, rope_theta=1e7, qk_norm=True,
                    tie_embeddings=False, compute_dtype="bfloat16"),
        dict(n_layers=5, window=2048, target_layers="5,19,33,47,61", features="offline",
             sliding_causal=True), block_size=8, anchors=2048),
}


def dflash_config(seq_len: int, anchors: int, target: ModelConfig = TARGET,
                  draft_layers: int = DRAFT_LAYERS, block_size: int = BLOCK,
                  drafter: dict | None = None) -> Config:
  """The bdlm_jax config of a dflash run: `model` the target, `drafter` its widths' defaults
  (or `drafter`'s fields)."""
  return replace(Config(), model=dataclasses.asdict(target), data=dict(seq_len=seq_len),
                 objective=dict(name="dflash", block_size=block_size, max_anchors=anchors),
                 drafter=drafter or dict(n_layers=draft_layers), train=dict(batch_size=1))


def recipe_config(recipe: Dflash2Recipe, seq_len: int) -> Config:
  cfg = dflash_config(seq_len, recipe.anchors, recipe.target, block_size=recipe.block_size,
                      drafter=recipe.drafter)
  return replace(cfg, objective=dict(anchors="locality"))


def kept_context_rows(plan, window: int) -> np.ndarray:
  """int64 [P]: each rank's context rows inside the union of the anchors' windows
  (`LayoutPlan.window_reach`): what context pruning projects (the rest no draft query sees)."""
  keep = plan.window_reach(window)
  pos = plan.rows[:, plan.n_noisy:] - plan.noisy_len
  return (keep[np.maximum(pos, 0)] & (pos >= 0)).sum(axis=1)


def drafter_params(cfg: Config) -> int:
  """Trainable parameters: the drafter's layers, fc and its two norms (the embedding and LM
  head are the frozen target's)."""
  d = drafter_model(cfg)
  n_feat = len(target_layer_ids(cfg))
  return param_count(dataclasses.replace(d, vocab_size=0)) + n_feat * d.d_model ** 2 + d.d_model


def dflash_works(strategy: str, cfg: Config, num_gpus: int) -> tuple[PlanWork, PlanWork]:
  """(drafter, target) work of one sequence: over every GPU, or one GPU when the strategy
  does not split sequences (`none`: data parallel). The drafter's pairs are its draft
  queries' (own block's draft rows, context before the anchor, within the window of a
  sliding-window drafter), split by whose K/V they read; anchors where `objective.anchors`
  puts them (`drafter_plan`: a locality run mid-sequence; else uniform). A windowed
  drafter's context is pruned (`kept_context_rows`): its K/V packets carry the largest
  owner's kept rows."""
  p = num_gpus if get_strategy(strategy).splits_sequences else 1
  window = cfg.drafter.window or None
  plan = drafter_plan(cfg, strategy, p)
  drafter = work_of(plan, window, causal_drafts=bool(window and cfg.drafter.sliding_causal))
  if window and drafter.n_travel:
    context = plan.rows_per_rank - plan.n_noisy
    packet = min(context, -(-kept_context_rows(plan, window).max() // PRUNED_TILE) * PRUNED_TILE)
    drafter = dataclasses.replace(drafter, n_travel=drafter.n_travel - context + packet)
  return drafter, context_work(strategy, cfg.data.seq_len, p)


def projected_context_rows(cfg: Config, plan) -> int:
  """Context rows a GPU runs through fc and the drafter's k/v projections: its clean slot,
  or with a sliding-window drafter only those some window reaches (context pruning)."""
  if cfg.drafter.window:
    return int(kept_context_rows(plan, cfg.drafter.window).max())
  return plan.rows_per_rank - plan.n_noisy


def feature_feed_s(cfg: Config, plan, hw: Hardware) -> tuple[float, float]:
  """(host-to-device, disk) seconds of one step's precomputed target features
  (`drafter.features`; 0 when the target runs in the step). Each GPU copies its own context
  rows' features, all of them (pruning happens on the device), over its host link
  (`host_gb_s`); the node reads the sequence's features from its NVMe once (`disk_gb_s`:
  a row several GPUs copy, as bp's replicated context, is read once into host memory), or
  where a strategy does not split sequences (`none`: a sequence per GPU) each of its GPUs'
  sequences."""
  if not cfg.drafter.features:
    return 0.0, 0.0
  row = len(target_layer_ids(cfg)) * cfg.model.d_model * FEATURE_BYTES
  context = plan.rows_per_rank - plan.n_noisy
  sequences = 1 if get_strategy(plan.strategy).splits_sequences else hw.gpus_per_node
  return (context * row / (hw.host_gb_s * GB),
          sequences * cfg.data.seq_len * row / (hw.disk_gb_s * GB))


def dflash_step_time(cfg: Config, drafter: PlanWork, target: PlanWork, hw: Hardware,
                     a: Assumptions, settings: RunSettings = OURS) -> dict:
  """Seconds of one sequence's step on its GPUs, and where they go. The target runs forward
  only (no remat, no backward, its ring moves K/V one way); the drafter forward + backward
  (each layer's forward once more under remat, `a.remat_forward`), its context k/v
  projections inside each layer, fc once. Every rank runs its context rows (L/P, or L under
  bp and none) through the target, fc and the drafter's context k/v; its draft rows through
  the drafter's layers and the LM head. fc's input (frozen features) and the head's weights
  (frozen) get no gradient: 4 FLOPs a parameter and row each, the head's 2 more where its
  loss chunk is rerun."""
  m, d = cfg.model, drafter_model(cfg)
  n_feat = len(target_layer_ids(cfg))
  matmul = hw.matmul_tflops * 1e12
  ctx_rows = projected_context_rows(cfg, drafter.plan)
  draft_rows = drafter.plan.n_noisy
  t_attn, _, t_busy = attention_s(m, target, target.stay_pairs, target.travel_pairs, hw, a)
  depth = target_depth(cfg)  # the target layers a step runs
  run = dataclasses.replace(m, n_layers=depth)
  t_linear = target.plan.rows_per_rank * linear_flops_per_row(run) / matmul
  fwd, bwd, busy = attention_s(d, drafter, drafter.stay_pairs, drafter.travel_pairs, hw, a)
  ctx_kv = 2 * d.d_model * kv_row(d)  # each drafter layer's k/v of the context
  d_linear = ((draft_rows * linear_flops_per_row(d) + ctx_rows * ctx_kv * d.n_layers)
              * (3 + a.remat_forward)
              + 2 * 2 * ctx_rows * n_feat * m.d_model * d.d_model
              + (2 + a.remat_forward) * 2 * draft_rows * d.d_model * m.vocab_size) / matmul
  parts = dict(target_linear_s=t_linear, target_attention_s=depth * t_attn,
               target_attention_busy_s=depth * t_busy, drafter_linear_s=d_linear,
               drafter_attention_s=d.n_layers * (fwd + bwd),
               drafter_attention_busy_s=d.n_layers * (1 + a.attention_bwd_factor) * busy)
  compute = t_linear + parts["target_attention_s"] + d_linear + parts["drafter_attention_s"]
  # Features from disk: the disk read is prefetched (the seed's loader thread, dflash/data.py
  # ~325-335), exposed only where it outlasts the step, for every group's sequence; a GPU
  # waits for its own copy unless that is prefetched too.
  h2d, disk = feature_feed_s(cfg, drafter.plan, hw)
  disk *= settings.sequence_groups
  total = max(compute, h2d, disk) if settings.prefetch_copy else max(compute + h2d, disk)
  return dict(total_s=total, **parts, compute_s=compute, feature_copy_s=h2d, feature_read_s=disk,
              comm_bytes_per_step=dflash_comm_bytes(cfg, drafter, a))


def dflash_comm_bytes(cfg: Config, drafter: PlanWork, a: Assumptions) -> float:
  """Bytes a GPU sends for attention in one step: the target's context K/V + metadata
  forward only on the layers it runs (`context_traffic`), and the drafter's travelling K/V
  as its transport moves them forward and backward (`attention_traffic`: draft and context
  rows under cp_*, context rows under csbp_*, nothing under bp)."""
  m, d = cfg.model, drafter_model(cfg)
  plan = drafter.plan
  traffic = attention_traffic(plan, kv_row(d) * a.compute_bytes, kv_row(d) * a.kv_grad_bytes,
                              a.meta_bytes_per_row, d.n_layers)
  unpruned = plan.rows_per_rank - plan.n_stay
  if unpruned and plan.travel != "none":  # context pruning shrinks the travelling rows
    traffic = {k: v * drafter.n_travel / unpruned for k, v in traffic.items()}
  context = context_traffic(plan, kv_row(m) * a.compute_bytes, a.meta_bytes_per_row,
                            target_depth(cfg))
  return wire_bytes({k: traffic[k] + context[k] for k in COLLECTIVE_KINDS}, plan.num_ranks)


def dflash_memory(cfg: Config, drafter: PlanWork, target: PlanWork, hw: Hardware,
                  a: Assumptions) -> dict:
  """Bytes per GPU, assumed. States: the frozen target's bf16 weights and the drafter's
  params, grads and Adam moments, ZeRO-3 over every GPU (`none` too: 8 data-parallel GPUs).
  Held through the step: the target's features at the chosen layers ([ctx rows, n + 1, D]:
  `Transformer.features` keeps a spare slot), the fc + norm output and its f32 gradient, the
  drafter's saved layer inputs and attention outputs (full remat). The largest transient:
  one target layer's forward (two gathered layers' weights, its projections and MLP over the
  context rows, the K/V its transport holds), one drafter layer's backward (its context K/V
  recomputed with f32 grads, the travelling K/V buffers, the draft rows' linear layers), or
  one loss chunk. With features from disk (`drafter.features`) the target's layers are not
  held and never run: its embedding and head stay, the features are [ctx rows, n, D] (the
  GPU's whole context slot: pruning keeps only the projected rows' fc output)."""
  m, d, e = cfg.model, drafter_model(cfg), a.compute_bytes
  n_feat = len(target_layer_ids(cfg))
  g = hw.num_gpus
  ctx, q = drafter.plan.rows_per_rank - drafter.plan.n_noisy, drafter.plan.n_noisy
  projected = projected_context_rows(cfg, drafter.plan)
  runs_target = target_depth(cfg) > 0
  frozen = param_count(m) if runs_target else m.vocab_size * m.d_model * 2
  states = frozen * e / g + drafter_params(cfg) * a.state_bytes_per_param / g
  target_layer = (param_count(m) - m.vocab_size * m.d_model * 2 - m.d_model) / m.n_layers
  held = (ctx * (n_feat + runs_target) * m.d_model * e + projected * d.d_model * (e + 4)
          + d.n_layers * q * ((d.d_model + d.n_heads * d.head_dim) * e + 4 * d.n_heads))
  kv_t, kv_d = kv_row(m), kv_row(d)
  t_kv = {"local": 0, "ring": 2 * target.n_travel * kv_t * e,
          "allgather": target.plan.num_ranks * target.n_travel * kv_t * e}[target.transport]
  target_tmp = runs_target * (2 * target_layer * e + t_kv + ctx * (
      3 * m.d_model + m.n_heads * m.head_dim + kv_t + 3 * m.d_ff) * e)
  d_kv = {"local": 0, "ring": 2 * drafter.n_travel * kv_d * (e + a.kv_grad_bytes),
          "allgather": (drafter.n_stay + drafter.plan.num_ranks * drafter.n_travel) * kv_d
          * (e + 4)}[drafter.transport]
  q_row = d.n_heads * d.head_dim
  d_linear = 2 * (q * 3 * d.d_ff + q * (d.d_model + q_row + kv_d // 2)) * e + q * q_row * 4
  drafter_tmp = projected * kv_d * (e + 4) + d_kv + d_linear
  logits_tmp = 2 * min(m.logits_chunk or q, q) * m.vocab_size * 4
  transient = max(target_tmp, drafter_tmp, logits_tmp)
  return dict(total_bytes=states + held + transient, states_bytes=states, held_bytes=held,
              transient_bytes=transient, target_tmp_bytes=target_tmp,
              drafter_tmp_bytes=drafter_tmp)


def dflash_project(hw: Hardware, a: Assumptions, seq_lens=SEQ_LENS, anchors=ANCHORS,
                   strategies=None, target: ModelConfig = TARGET,
                   draft_layers: int = DRAFT_LAYERS) -> list[dict]:
  """One row per (L, anchor rule, strategy) on `hw` (8 GPUs), for every registered strategy
  with a plan of its own (`distinct_plans`) unless `strategies` are given. `seq_s` is the time
  per sequence: the step time of one sequence over all GPUs, or where a strategy does not
  split sequences (`none`, data parallel: one sequence per GPU) a GPU's step time / the GPU
  count."""
  rows = []
  for seq_len in seq_lens:
    for anchor_rule, count in anchors:
      cfg = dflash_config(seq_len, count(seq_len), target, draft_layers)
      rows += strategy_rows(cfg, hw, a, strategies, anchor_rule=anchor_rule)
  return rows


def strategy_rows(cfg: Config, hw: Hardware, a: Assumptions, strategies=None,
                  settings: RunSettings = OURS, **labels) -> list[dict]:
  """One row per strategy (every one with a plan of its own unless given) of the dflash run
  `cfg` on `hw` under `settings` (a sequence split over a group of `hw`'s GPUs, the groups
  data parallel), each labelled with `labels`, its L and A. `seq_s`: the node's time per
  sequence."""
  o, rows = cfg.objective, []
  useful = model_flops_per_step(cfg)
  groups = settings.sequence_groups
  group = dataclasses.replace(hw, gpus_per_node=hw.num_gpus // groups, nodes=1)
  a = dataclasses.replace(a, remat_forward=settings.remat_forward,
                          state_bytes_per_param=settings.state_bytes_per_param)
  names = strategies or distinct_plans(strategy_names(), cfg.data.seq_len, o.block_size,
                                        group.num_gpus, o.max_anchors)
  for s in names:
    drafter, target_work = dflash_works(s, cfg, group.num_gpus)
    row = dict(seq_len=cfg.data.seq_len, anchors=o.max_anchors, **labels, strategy=s,
               settings=settings.name, sequence_gpus=group.num_gpus,
               **dflash_step_time(cfg, drafter, target_work, group, a, settings),
               **dflash_memory(cfg, drafter, target_work, hw, a))
    sequences = groups * (1 if get_strategy(s).splits_sequences else group.num_gpus)
    row["seq_s"] = row["total_s"] / sequences
    row["seq_compute_s"] = row["compute_s"] / sequences
    row["fits"] = row["total_bytes"] <= hw.usable_bytes
    row["mfu"] = useful / (row["seq_s"] * hw.num_gpus * hw.peak_tflops * 1e12)
    row["dominant"] = _dominant(row)
    rows.append(row)
  return rows


def dflash2_project(hw: Hardware, a: Assumptions, recipes=DFLASH2_RECIPES,
                    seq_lens=SEQ_LENS) -> list[dict]:
  """`strategy_rows` of each DFlash2 recipe at each L, on `hw` (8 H100)."""
  return [row for name, recipe in recipes.items() for seq_len in seq_lens
          for row in strategy_rows(recipe_config(recipe, seq_len), hw, a, recipe=name)]


def dflash2_seed_project(hw: Hardware, a: Assumptions, recipes=DFLASH2_RECIPES,
                         seq_lens=SEQ_LENS) -> list[dict]:
  """Each DFlash2 recipe at each L under the seed's settings (`SEED`): CSBP as its recipe
  runs it (csbp_* on each group of 4 GPUs, two sequences at once) and the paper's candidate
  baselines on the node's 8 GPUs, one sequence at a time: every draft block on every rank
  (the paper's, `PAPER_BASELINE`: CP 8, BP 1) and the context replicated
  (`CONTEXT_REPLICATED`: BP 8)."""
  whole_node = dataclasses.replace(SEED, sequence_groups=1)
  return [row for name, recipe in recipes.items() for seq_len in seq_lens
          for strategies, settings in ((CSBP, SEED),
                                       ((PAPER_BASELINE, CONTEXT_REPLICATED), whole_node))
          for row in strategy_rows(recipe_config(recipe, seq_len), hw, a, strategies,
                                   settings, recipe=name)]


def paper_comparison(rows: list[dict]) -> list[dict]:
  """Per (recipe, L): the best fitting CSBP against the paper's baseline (every draft block
  on every rank) and against our best fitting baseline (cp_*, bp), per sequence, as the
  step with its features fed (`seq_s`) and as its compute alone (`seq_compute_s`: features
  already on the GPU, as a profile with device-resident features measures)."""
  out = []
  for key in dict.fromkeys((r["recipe"], r["seq_len"]) for r in rows):
    group = {r["strategy"]: r for r in rows if (r["recipe"], r["seq_len"]) == key}
    best = lambda names, part: min((group[s] for s in names if s in group and group[s]["fits"]),
                                   key=lambda r: r[part], default=None)
    row = dict(recipe=key[0], seq_len=key[1], oom=[s for s, r in group.items() if not r["fits"]])
    for part, suffix in (("seq_s", ""), ("seq_compute_s", "_compute")):
      csbp, ours, paper = best(CSBP, part), best(BASELINES, part), group.get(PAPER_BASELINE)
      row.update({f"csbp{suffix}": csbp, f"paper{suffix}": paper, f"ours{suffix}": ours,
                  f"over_paper{suffix}": paper[part] / csbp[part] if paper and csbp else None,
                  f"over_ours{suffix}": ours[part] / csbp[part] if ours and csbp else None})
    out.append(row)
  return out


def _dominant(row: dict) -> str:
  """The largest part of a dflash step (waiting for the ring or exposed transfers apart)."""
  parts = {"target linear": row["target_linear_s"],
           "target attention": row["target_attention_busy_s"],
           "target K/V transfer/wait": row["target_attention_s"] - row["target_attention_busy_s"],
           "drafter linear": row["drafter_linear_s"],
           "drafter attention": row["drafter_attention_busy_s"],
           "drafter K/V transfer/wait": (row["drafter_attention_s"]
                                         - row["drafter_attention_busy_s"])}
  name = max(parts, key=parts.get)
  return f"{name} {parts[name] / row['total_s']:.0%}"


def drafter_s(row: dict) -> float:
  """The drafter's part of a step: what it would take were the target's features given."""
  return row["drafter_linear_s"] + row["drafter_attention_s"]


def dflash_speedups(rows: list[dict]) -> list[dict]:
  """Per (L, anchor rule): best fitting CSBP over the best fitting baseline (cp_*, bp), and
  over every baseline and data parallelism with memory ignored."""
  out = []
  for key in dict.fromkeys((r["seq_len"], r["anchor_rule"]) for r in rows):
    group = {r["strategy"]: r for r in rows if (r["seq_len"], r["anchor_rule"]) == key}
    baselines = [s for s in BASELINES if s in group]
    best = lambda names, fit=True: min((group[s] for s in names if s in group
                                        and (group[s]["fits"] or not fit)),
                                       key=lambda r: r["seq_s"], default=None)
    base, csbp, csbp_any = best(baselines), best(CSBP), best(CSBP, False)
    out.append(dict(seq_len=key[0], anchor_rule=key[1], anchors=csbp_any["anchors"],
                    baseline=base and base["strategy"], csbp=csbp and csbp["strategy"],
                    speedup=base["seq_s"] / csbp["seq_s"] if base and csbp else None,
                    over_any={s: group[s]["seq_s"] / csbp_any["seq_s"]
                              for s in baselines + [SINGLE_DEVICE] if s in group},
                    drafter_only={s: drafter_s(group[s]) / drafter_s(csbp_any)
                                  for s in baselines},
                    target_share=1 - drafter_s(csbp_any) / csbp_any["total_s"]))
  return out
