"""Comparing arrays computed in two ways (another schedule, remat, chunking, a resume).

Per tensor, max |got - want| / max |want|: an element-wise atol of 1e-7 fails on one element of
a gradient whose CPU reduction order differs (a 7e-4 entry off by 1.4e-7 on one machine, 3e-6
of the tensor's largest), whereas scaled by the tensor's largest entry the same error reads as
what it is, and a wrong entry of a small tensor still fails."""

import jax
import numpy as np


def max_relative_error(got, want) -> float:
  """max |got - want| / max |want| of one tensor (0 when both are all zeros)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  scale = np.abs(want).max(initial=0.0)
  diff = np.abs(got - want).max(initial=0.0)
  return diff / scale if scale else diff


def assert_trees_close(got, want, rel: float):
  """Every leaf of `got` within `rel` of `want`'s (max_relative_error), naming the leaf."""
  want_leaves = jax.tree.leaves(want)
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
  for (path, g), w in zip(got_leaves, want_leaves):
    err = max_relative_error(g, w)
    assert err <= rel, f"{jax.tree_util.keystr(path)}: max |a - b| / max |b| = {err:.3g} > {rel}"
