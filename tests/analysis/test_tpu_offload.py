"""model.remat=offload on XLA:TPU (ahead of time, libtpu, no TPU): the saved residuals that
remat=full keeps on the device are compiled into host memory. Skipped without libtpu."""

import pytest

pytest.importorskip("libtpu")

from bdlm_jax.analysis import step_report as sr  # noqa: E402
from bdlm_jax.analysis import targets  # noqa: E402
from bdlm_jax.parallel.mesh import make_mesh  # noqa: E402
from tests.analysis.test_tpu_target import TARGET, TINY, config  # noqa: E402

LAYERS, D, ROWS = 4, 256, 64  # rows per rank: 2 x 128 tokens over 4 ranks


def _report(remat):
  cfg = config("csbp_ring", model=dict(TINY, n_layers=LAYERS, d_model=D, remat=remat))
  return sr.step_report(cfg, make_mesh(cfg, targets.resolve(TARGET).devices))


def test_offload_puts_the_saved_residuals_in_host_memory():
  """At least what each layer saves (its input and attention output in bf16, the f32 LSE, the
  int32 positions and row metadata and the f32 router row weight, per row) is in host memory
  under remat=offload (XLA:TPU pads small arrays to its tiles, so it may hold more), and
  nothing is under remat=full."""
  heads, head_dim = TINY["n_heads"], TINY["head_dim"]
  per_row = D * 2 + heads * head_dim * 2 + heads * 4 + 6 * 4 + 4
  assert _report("full").host_bytes == 0
  assert _report("offload").host_bytes >= LAYERS * ROWS * per_row
