"""The logical training stream `[x_t ; x_0]` and the row arrays every objective fills in.

Row r < L is the noisy copy of position r, row L + p the clean copy of position p; both
halves use positions 0..L-1 for RoPE. Objectives decide each row's block, label and
whether corruption may touch it; layouts then permute the rows (bdlm_jax.parallel.layout).
"""

import numpy as np

from bdlm_jax.kernels.mask import CLEAN, NOISY

# Values of padding rows that layouts insert: no document, no label, never masked.
PAD_VALUES = dict(tokens=0, labels=-1, maskable=False, pos=0, block=0, seg=0, stream=NOISY)


def logical_stream(tokens_SL: np.ndarray, seg_SL: np.ndarray) -> dict[str, np.ndarray]:
  """tokens, pos, seg, stream for the 2L rows of `[x_t ; x_0]`, int32 [S, 2L]."""
  s, l = tokens_SL.shape
  pos = np.broadcast_to(np.tile(np.arange(l, dtype=np.int32), 2), (s, 2 * l))
  stream = np.broadcast_to(np.repeat(np.array([NOISY, CLEAN], np.int32), l), (s, 2 * l))
  return dict(tokens=np.concatenate([tokens_SL, tokens_SL], 1).astype(np.int32),
              pos=pos.copy(), seg=np.concatenate([seg_SL, seg_SL], 1).astype(np.int32),
              stream=stream.copy())
