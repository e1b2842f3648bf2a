"""Bytes per GPU: assumed from what a step holds, or compiled where scale_probe ran.

Assumed: model states (ZeRO-3 over all GPUs) + what full remat saves per layer (the layer
input, the attention output and its LSE, a local layer's exchanged K/V) + the largest
transient (one layer's backward, or one loss chunk of `model.logits_chunk` rows). Compiled:
the per-device peak of the real train step that experiments/scale_probe.py compiled
(`load_probe`), used for every block size of that (model, L, strategy), since B moves memory
only through layout padding. The assumption reads about half of every compile.
"""

import csv

from bdlm_jax.analysis.cost_model.setting import MODELS, Assumptions, Hardware
from bdlm_jax.analysis.cost_model.work import (PlanWork, attention_kinds, expert_slots, kv_row,
                                               moe_layers)
from bdlm_jax.config import ModelConfig
from bdlm_jax.metrics import param_count
from bdlm_jax.parallel.strategies import exchange_for, window_transport


def peak_memory(m: ModelConfig, work: PlanWork, hw: Hardware, a: Assumptions) -> dict:
  """Bytes per rank, assumed: states + saved activations + the largest transient buffer, of
  the layer kind (global, local of window W) that needs the most."""
  e = a.compute_bytes
  rows = work.plan.rows_per_rank
  kv = kv_row(m)
  q_row = m.n_heads * m.head_dim
  states = param_count(m) * a.state_bytes_per_param / hw.num_gpus
  # Saved per layer (full remat, `models.transformer.remat_policy`): the layer input and the
  # attention core's output and LSE, and a local layer's exchanged K/V rows with their
  # metadata; q, K/V and any gathered K/V are recomputed.
  saved_layer = rows * ((m.d_model + q_row) * e + 4 * m.n_heads)
  # Transient while one layer runs its backward: recomputed MLP/projections and their
  # gradients, the f32 dq, and the K/V buffers in flight with their f32 gradients. An MoE's
  # MLP runs on its experts' received rows: they, the rows sent and received back, and the
  # experts' intermediates (`parallel.experts`, ragged_all_to_all dispatch).
  if moe_layers(m):
    pairs, slots = expert_slots(m, rows, hw.num_gpus)
    mlp = slots * 3 * (m.moe_d_ff or m.d_ff) + 2 * (pairs + slots) * m.d_model
  else:
    mlp = rows * 3 * m.d_ff
  linear_tmp = 2 * (mlp + rows * (m.d_model + q_row + kv // 2)) * e + rows * q_row * 4
  if work.transport == "ring":
    kv_tmp = 2 * work.n_travel * kv * (e + a.kv_grad_bytes)  # current + next, kv + dkv
  else:  # every visible key's K/V and f32 dK/dV (the all-gather gathers all ranks' part)
    gathered = work.plan.num_ranks * work.n_travel
    kv_tmp = (work.n_stay + gathered) * kv * (e + 4)
  saved = transient = 0
  for window, n in attention_kinds(m):
    layer_saved, layer_kv = saved_layer, kv_tmp
    if window is not None and window_transport(work.plan, window) == "exchange":
      received = exchange_for(work.plan, window).rows_sent()
      layer_saved += received * (kv * e + a.meta_bytes_per_row)
      layer_kv = (rows + received) * kv * 2 * e  # [own ; received] K/V and their dK/dV
    saved += n * layer_saved
    transient = max(transient, linear_tmp + layer_kv)
  chunk = min(m.logits_chunk or work.plan.n_noisy, work.plan.n_noisy)  # loss.chunked_loss
  logits_tmp = 2 * chunk * m.vocab_size * 4
  transient = max(transient, logits_tmp)
  total = states + saved + transient
  return dict(total_bytes=total, states_bytes=states, saved_bytes=saved,
              transient_bytes=transient)


def load_probe(path: str, hw: Hardware) -> dict:
  """{(model, L, B, strategy): compiled peak bytes} from a scale_probe CSV: full-depth rows
  of `MODELS` on `hw.num_gpus` devices that compiled; of an MoE, the ragged dispatch (the
  GPU's) compiled with stand-ins, not the all_gather one XLA:CPU runs. The CSV does not
  record the layer pattern: its gemma3-27b rows were compiled with every layer global, and
  stand as that model's memory (a measured figure of the same model, kept in preference to
  the assumption)."""
  with open(path) as f:
    rows = list(csv.DictReader(f))
  return {(r["model"], int(r["seq_len"]), int(r["block_size"]), r["strategy"]):
          float(r["peak_bytes"]) for r in rows
          if r["model"] in MODELS and not r["error"] and not r["depth_check"]
          and not r.get("overrides")
          and (r.get("standins") == "True") == bool(MODELS[r["model"]].moe_experts)
          and int(r["devices"]) == hw.num_gpus and r["remat"] == "full"
          and int(r["layers"]) == MODELS[r["model"]].n_layers}


def compiled_peak(compiled: dict, model: str, seq_len: int, block_size: int, strategy: str):
  """The compiled peak of this setting, else of the same (model, L, strategy) compiled at
  another block size, else None."""
  exact = compiled.get((model, seq_len, block_size, strategy))
  if exact is not None:
    return exact
  return next((v for (m, n, _, s), v in compiled.items() if (m, n, s) == (model, seq_len,
                                                                           strategy)), None)
