"""kernel_bench times every peer with its mask built the same way: from the row metadata,
an argument of the timed function (a dense peer also with its mask built outside it)."""

import time

import jax.numpy as jnp

from experiments import kernel_bench as kb


def test_every_peer_builds_its_mask_from_metadata_in_the_timed_function():
  rows = []
  kb.run_case("bdlm", 32, 4, (2, 1, 16), jnp.float32, [("pallas", None), ("xla", None),
                                                       ("cudnn", None)],
              reps=1, writer=rows.append, deadline=time.time() + 600)
  built = {(r["peer"], r["mode"], r["mask_built"]) for r in rows}
  assert built == {(peer, mode, how) for mode in ("fwd", "fwd+bwd")
                   for peer, how in [("pallas", "in step"), ("xla", "in step"),
                                     ("cudnn", "in step"), ("cudnn", "outside")]}
  timed = [r for r in rows if r["peer"] != "cudnn"]
  assert all(float(r["ms"]) > 0 for r in timed)
  xla_fwd = next(r for r in timed if (r["peer"], r["mode"]) == ("xla", "fwd"))
  assert float(xla_fwd["err_vs_pallas"]) < 1e-4
  # L (L + B) of the (2L)^2 pairs are allowed
  assert all(r["allowed_fraction"] == round(36 * 32 / 64**2, 4) for r in rows)
  assert all(r["note"] == "skipped: needs a GPU" for r in rows if r["peer"] == "cudnn")
