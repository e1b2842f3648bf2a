"""Per-step metrics: throughput, model-FLOPs utilisation, memory; JSONL + TensorBoard + tqdm."""

import dataclasses
import json
import math

import jax
import numpy as np
from etils import epath

from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.models.drafter import drafter_model, target_depth, target_layer_ids
from bdlm_jax.models.pattern import attention_shape, gdn_shape, layer_types, mlp_types
from bdlm_jax.objectives import get_objective
from bdlm_jax.parallel.registry import SINGLE_DEVICE, drafter_plan, make_plan

# Dense bf16 peak per device, for the MFU estimate when train.peak_tflops is not set.
_PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "tpu v5": 197.0, "tpu v4": 275.0}


def _layer_weights(m: ModelConfig, mlp: str, active: bool, kind: str = "global") -> int:
  """One layer's linear weights: attention projections (of its kind's shapes) and its MLP,
  dense or a mixture of experts (the router, and all E experts or, `active`, the k a row is
  sent to; with `moe_beside_dense` a dense MLP beside them)."""
  if kind == "gdn":
    attention = gdn_projection_weights(m)
  else:
    kv_heads, head_dim, k_eq_v = attention_shape(m, kind)
    q_heads = 2 * m.n_heads if m.attention_gate else m.n_heads  # [q | gate]
    attention = (m.d_model * (q_heads + (1 if k_eq_v else 2) * kv_heads) * head_dim  # qkv
                 + m.n_heads * head_dim * m.d_model)  # o
  dense = 3 * m.d_model * m.d_ff
  if mlp == "dense":
    return attention + dense
  experts = m.moe_top_k if active else m.moe_experts
  return (attention + m.d_model * m.moe_experts + experts * 3 * m.d_model * (m.moe_d_ff or m.d_ff)
          + (dense if m.moe_beside_dense else 0))


def gdn_projection_weights(m: ModelConfig) -> int:
  """A Gated DeltaNet layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj."""
  hk, hv, dk, dv = gdn_shape(m)
  return m.d_model * (2 * hk * dk + 3 * hv * dv + 2 * hv)


def linear_flops_per_row(m: ModelConfig) -> int:
  """Forward FLOPs of one row through every layer's linear maps: 2 per active weight."""
  return sum(2 * _layer_weights(m, mlp, True, kind)
             for mlp, kind in zip(mlp_types(m), layer_types(m)))


def param_count(m: ModelConfig, active: bool = False) -> int:
  """The model's parameters (what memory holds), or with `active` those one token computes
  with (an MoE layer's router and the k experts it is sent to: what its FLOPs count)."""
  hk, hv, dk, dv = gdn_shape(m)
  # A Gated DeltaNet layer's other weights: conv, dt_bias, A_log, its gated norm.
  gdn = (2 * hk * dk + hv * dv) * m.gdn_conv + 2 * hv + dv
  norms = lambda kind: 2 * m.d_model + (gdn if kind == "gdn" else
                                        2 * attention_shape(m, kind).head_dim if m.qk_norm
                                        else 0)
  embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
  return (embed + sum(_layer_weights(m, mlp, active, kind) + norms(kind)
                      for mlp, kind in zip(mlp_types(m), layer_types(m))) + m.d_model)


def model_flops_per_step(cfg: Config) -> float:
  """Useful training FLOPs of one optimiser step (forward + backward = 3x forward).

  Linear layers see every logical row once (2L rows for diffusion objectives: noisy and
  clean copies), a mixture of experts only its router and the k experts a row is sent to;
  attention counts only allowed (query, key) pairs of the mask. A drafter (dflash) adds its
  frozen target's forward over the L context rows (1x: no backward) to its own training.
  """
  m, objective = cfg.model, get_objective(cfg.objective.name)
  if objective.DRAFTER:
    return _drafter_flops_per_step(cfg)
  diffusion = objective.NOISY_STREAM
  rows = 2 * cfg.data.seq_len if diffusion else cfg.data.seq_len
  linear = rows * linear_flops_per_row(m) + 2 * cfg.data.seq_len * m.d_model * m.vocab_size
  # Pairs of the logical stream, as one device computes them: redundant work that a
  # strategy adds (bp's replicated clean prefix) is not useful work.
  block_size = cfg.objective.block_size if diffusion else 1
  plan = make_plan(SINGLE_DEVICE, cfg.data.seq_len, block_size, 1, diffusion)
  kinds = layer_types(m)
  pairs = {"global": plan.attention_work().sum(),
           "local": plan.attention_work(m.sliding_window).sum() if "local" in kinds else 0}
  attention = 4 * m.n_heads * sum(float(pairs[k]) * attention_shape(m, k).head_dim
                                  for k in kinds if k != "gdn")
  # A Gated DeltaNet row, per value head: k^T S, the rank-1 update and S^T q (2 K V each).
  hk, hv, dk, dv = gdn_shape(m)
  attention += kinds.count("gdn") * rows * hv * 6 * dk * dv
  return 3.0 * cfg.train.batch_size * objective.COPIES * (linear + attention)


def _drafter_flops_per_step(cfg: Config) -> float:
  """The target's causal forward over L rows (the layers `target_depth` runs: none with
  precomputed features), then the drafter's forward + backward: its layers over the A*B
  draft rows and the allowed draft-query pairs (windowed, causal inside a block where the
  config says so), its fc and k/v projections over the context rows some window reaches (all
  L without a window), the logits of the draft rows; anchors at their expected places
  (`drafter_plan`). fc's input (frozen features) and the head (frozen) need no gradient:
  forward and one gradient each."""
  m, d, L = cfg.model, drafter_model(cfg), cfg.data.seq_len
  n_feat, window = len(target_layer_ids(cfg)), cfg.drafter.window or None
  run = dataclasses.replace(m, n_layers=target_depth(cfg))  # the target layers that run
  target = (L * linear_flops_per_row(run)
            + 4.0 * L * (L + 1) / 2 * m.n_heads * m.head_dim * run.n_layers)
  plan = drafter_plan(cfg, SINGLE_DEVICE, 1)
  draft_rows = plan.noisy_len
  context = int(plan.window_reach(window).sum()) if window else L
  pairs = plan.attention_work(window, causal_drafts=bool(window and cfg.drafter.sliding_causal))
  ctx_kv = 2 * d.d_model * 2 * d.n_kv_heads * d.head_dim * d.n_layers
  trained = (draft_rows * linear_flops_per_row(d) + context * ctx_kv
             + 4.0 * float(pairs.sum()) * d.n_heads * d.head_dim * d.n_layers)
  frozen = (draft_rows * 2 * d.d_model * m.vocab_size
            + context * 2 * n_feat * m.d_model * d.d_model)
  return cfg.train.batch_size * (target + 3.0 * trained + 2.0 * frozen)


def peak_flops(cfg: Config) -> float:
  if cfg.train.peak_tflops > 0:
    return cfg.train.peak_tflops * 1e12 * jax.device_count()
  kind = jax.devices()[0].device_kind.lower()
  for name, tflops in _PEAK_TFLOPS.items():
    if name in kind:
      return tflops * 1e12 * jax.device_count()
  return 0.0


def peak_memory_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else int(stats.get("peak_bytes_in_use", 0))


class MetricsWriter:
  """Appends one JSON object per logged step and mirrors scalars to TensorBoard.

  `start` is the step training (re)starts from: rows logged after it by an earlier run in
  `workdir` are dropped (TensorBoard events purged), as those steps are trained again and
  each step should be logged once.
  """

  def __init__(self, workdir: epath.PathLike, start: int = 0, enabled: bool = True):
    self.enabled = enabled and jax.process_index() == 0
    if not self.enabled:
      return
    from tensorboardX import SummaryWriter
    workdir = epath.Path(workdir)
    path = workdir / "metrics.jsonl"
    if path.exists():
      rows = path.read_text().splitlines(keepends=True)
      kept = [row for row in rows if _logged_step(row) <= start]
      if kept != rows:
        tmp = path.parent / f"{path.name}.tmp"
        tmp.write_text("".join(kept))
        tmp.replace(path)
    self._jsonl = path.open("a")
    self._tb = SummaryWriter(str(workdir / "tb"), purge_step=start + 1)

  def write(self, step: int, scalars: dict) -> None:
    """None (a figure this backend cannot give, e.g. MFU on CPU) is kept as JSON null."""
    if not self.enabled:
      return
    row = {k: None if v is None else float(np.asarray(v)) for k, v in scalars.items()}
    self._jsonl.write(json.dumps(dict(step=step, **row)) + "\n")
    self._jsonl.flush()
    for k, v in row.items():
      if v is not None:
        self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def evaluated_at(workdir: epath.PathLike, step: int) -> dict | None:
  """The row of `workdir`'s metrics.jsonl at `step` if it has held-out metrics, or None."""
  path = epath.Path(workdir) / "metrics.jsonl"
  rows = [json.loads(r) for r in path.read_text().splitlines()
          if _logged_step(r) == step] if path.exists() else []
  return next((r for r in reversed(rows) if "eval_loss" in r), None)


def _logged_step(row: str) -> float:
  """The step of a metrics.jsonl row; a torn row (a crash mid-write) counts as after all."""
  try:
    return json.loads(row)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf
