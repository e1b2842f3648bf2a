"""memory_breakdown's side-by-side tables, on two made-up breakdowns (no compile): a buffer that
one compiler keeps in f32 and the other in bf16 is listed as widened, one that only one peak
holds as held there alone, and a buffer alike on both is not listed."""

import os
import sys

from bdlm_jax.analysis import buffers, step_report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import memory_breakdown  # noqa: E402


def made(*held, peak=None) -> buffers.Breakdown:
  report = step_report.StepReport(
      argument_bytes=100, temp_bytes=900, output_bytes=100, alias_bytes=100,
      compiler_peak_bytes=peak, host_bytes=0, compile_s=1.0, collective_bytes={},
      attention_collective_bytes={}, attention_bytes=0.0, expected_attention_operand_bytes=0.0)
  return buffers.Breakdown(tuple(held), report, "cpu" if peak is None else "tpu")


def buffer(name, nbytes, shape, category, residual=""):
  return buffers.Buffer(name, nbytes, shape, "fusion", "", "temp", category, residual)


def test_widened_and_held_alone_are_listed_and_alike_buffers_are_not():
  state = buffer("param.1", 100, "f32[8,4]", buffers.STATE)
  named = {"XLA:CPU": made(buffer("convert.1", 400, "f32[2,1,64,32]", buffers.RESIDUALS,
                                  buffers.LAYER_INPUT),
                           buffer("copy.2", 300, "f32[64,64]", buffers.ACTIVATIONS), state),
           "XLA:TPU": made(buffer("while.3{2}", 200, "bf16[2,1,64,32]", buffers.RESIDUALS,
                                  buffers.LAYER_INPUT), state, peak=400)}
  lines = memory_breakdown.widened(named)
  assert lines[2] == ("| layer input (scan carry) [2,1,64,32] | 1 x f32 (4e-07 GB) | "
                      "1 x bf16 (2e-07 GB) |")
  assert lines[3] == "| activations (other) [64,64] | 1 x f32 (3e-07 GB) | none |"
  assert len(lines) == 4  # the state, alike on both, is not listed
  assert "| saved residuals | 4e-07 | 2e-07 | 2.00 |" in memory_breakdown.category_table(named)
  figures = memory_breakdown.figures_table(named)
  assert "| compiler's peak_memory_in_bytes | — | 4e-07 |" in figures
  assert "| buffers live at the peak (sum) | 8e-07 | 3e-07 |" in figures
