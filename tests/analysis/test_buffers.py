"""The memory breakdown read from XLA's buffer assignment (analysis/buffers.py): its buffers
are the compiler's peak, its categories move when the feature behind them changes."""

import functools
import importlib.util

import pytest

from bdlm_jax.analysis import buffer_assignment, buffers, plan_mode, step_report
from bdlm_jax.config import Config
from bdlm_jax.configure import override, replace
from bdlm_jax.parallel.mesh import make_mesh

# A vocabulary wide enough that the loss holds the peak, whole (logits_chunk=0) or chunked.
TINY = dict(vocab_size=4096, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
            d_ff=64, attention_chunk=32, remat="full", logits_chunk=0)


def config(*overrides, **sections) -> Config:
  base = dict(model=TINY, data=dict(seq_len=256), objective=dict(block_size=16, mask_token_id=4095),
              parallel=dict(strategy="csbp_ring", seq=4), train=dict(batch_size=1))
  return override(replace(Config(), **{**base, **sections}), overrides)


@functools.cache
def breakdown(*overrides) -> buffers.Breakdown:
  cfg = config(*overrides)
  return buffers.step_breakdown(cfg, make_mesh(cfg))[1]


@pytest.mark.slow
def test_the_buffers_live_at_the_peak_are_within_xla_cpus_bound_and_hold_every_argument():
  """XLA:CPU keeps the arguments live through the step: the state and batch buffers at the
  peak are memory_analysis's arguments but a few hundred bytes at most (the PRNG key, dead
  once the noise is drawn, and scalars or norm scales the step has finished with: 132 bytes
  since the step also reports its update and weight norms), and all that is live then is at
  most the bound arguments + temp + output - alias (the temp buffers not live at the peak
  aside)."""
  b = breakdown()
  r, by = b.report, b.by_category()
  assert 0 <= r.argument_bytes - (by[buffers.STATE] + by[buffers.BATCH]) <= 512
  assert by[buffers.STATE] > 0.9 * r.argument_bytes
  assert r.argument_bytes < b.device_bytes <= r.bound_bytes
  assert "x the bound arguments" in b.relation()


def test_each_buffer_is_sorted_into_one_category_and_the_tables_name_them():
  b = breakdown()
  by = b.by_category()
  assert set(by) == set(buffers.CATEGORIES)
  assert sum(by.values()) == sum(x.nbytes for x in b.buffers)
  assert by[buffers.RESIDUALS] > 0 and by[buffers.LOSS] > 0 and by[buffers.HOST] == 0
  assert list(b.by_residual())[0] in (buffers.LAYER_INPUT, "attention_out")
  text = "\n".join(b.lines(top=5))
  assert "| state: parameters, optimizer state |" in text and "Saved residuals" in text
  assert [x.nbytes for x in b.buffers] == sorted((x.nbytes for x in b.buffers), reverse=True)


@pytest.mark.slow
def test_a_smaller_logits_chunk_shrinks_the_loss_chunk():
  whole, chunked = breakdown(), breakdown("model.logits_chunk=16")
  assert chunked.by_category()[buffers.LOSS] < whole.by_category()[buffers.LOSS] / 2


@pytest.mark.slow
def test_remat_full_saves_fewer_residuals_than_none():
  full, none = breakdown(), breakdown("model.remat=none")
  assert full.by_category()[buffers.RESIDUALS] < none.by_category()[buffers.RESIDUALS] / 2


@pytest.mark.slow
def test_the_stacks_of_a_period_scan_are_saved_residuals_where_periods_do_not_divide_the_layers():
  """7 layers of a 3-layer pattern scan as 2 periods, then a run of 1 layer: stacks with a
  leading 2, which does not divide 7 (as 10 periods do not divide Gemma 3 27B's 62 layers)."""
  periodic = ("model.n_layers=7", "model.layer_pattern=local,local,global",
              "model.sliding_window=32", "model.remat=none")
  rows = buffers._Dims.of(config(*periodic)).rows
  dims = [buffer_assignment.array(x.shape)[1] for x in breakdown(*periodic).buffers]
  stacks = [x for x, d in zip(breakdown(*periodic).buffers, dims)
            if len(d) > 2 and d[0] == 2 and rows in d[1:]]
  assert stacks and {x.category for x in stacks} == {buffers.RESIDUALS}


def test_plan_breakdown_adds_the_chosen_strategys_breakdown_below_the_verdict(monkeypatch):
  """plan.breakdown=true: the chosen strategy (the least peak where none fits) compiled
  once more for its breakdown, printed below the table and the `chosen:` line."""
  report = breakdown().report
  monkeypatch.setattr(step_report, "compare_strategies",
                      lambda *_: [(s, report) for s in ("cp_ring", "csbp_ring")])
  seen = []
  monkeypatch.setattr(buffers, "step_breakdown",
                      lambda c, mesh: seen.append(c.parallel.strategy) or (report, breakdown()))
  text = plan_mode.plan_report(config("plan.breakdown=true"))
  chosen = next(line for line in text.splitlines() if line.startswith("chosen: "))
  assert chosen.startswith(f"chosen: {seen[0]} ")
  assert text.index(chosen) < text.index(f"Breakdown of {seen[0]}'s step") < \
      text.index("| state: parameters, optimizer state |")
  assert "Breakdown of" not in plan_mode.plan_report(config())
  rows = [dict(strategy=s, peak_bytes=p, total_s=1.0) for s, p in (("cp_ring", 2), ("bp", 1))]
  plan_mode.breakdown_lines(config(), rows, device_bytes=0, mesh=None)  # none fits
  assert seen[-1] == "bp"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (requirements-tpu.txt)")
def test_on_xla_tpu_the_breakdown_stays_within_the_compilers_own_peak():
  """On this tiny step most arrays sit in on-chip memory or are smaller than a tile, so the
  device bytes at the peak are only below the compiler's peak_memory_in_bytes; at 8B dims
  they equal it (experiments/results/memory_breakdown.md)."""
  from bdlm_jax.analysis import targets
  cfg = config("model.compute_dtype=bfloat16", "model.vocab_size=260", "data.seq_len=128",
               "objective.mask_token_id=259", "plan.target=tpu:v5e:2x2")
  b = buffers.step_breakdown(cfg, make_mesh(cfg, targets.resolve("tpu:v5e:2x2").devices))[1]
  peak = b.report.compiler_peak_bytes
  assert peak is not None and 0 < b.device_bytes <= peak
  assert b.by_category()[buffers.STATE] > 0
  assert "x the compiler's peak_memory_in_bytes" in b.relation()
