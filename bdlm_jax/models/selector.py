"""DFlash2's candidate selector (docs/dflash.md, "DFlash2"), after the seed's
`CandidateSelector` (`core/models/backbones/dflash/dflash2.py` ~389-470): a low-rank,
predecessor-conditioned re-scorer of the frozen head's top-K candidates at each draft slot.

score(c | prev, h) = unary(c) + sum_r pred[prev]_r (W h)_r succ[c]_r, with codebooks
pred, succ [V, r] and W: d_model -> r. The successor codebook starts at zero, so an untrained
selector keeps the head's order.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class CandidateSelector(nnx.Module):
  def __init__(self, d_model: int, vocab_size: int, rank: int, param_dtype, rngs: nnx.Rngs):
    self.predecessor_codebook = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (vocab_size, rank), param_dtype))
    self.successor_codebook = nnx.Param(jnp.zeros((vocab_size, rank), param_dtype))
    self.hidden_projection = nnx.Linear(d_model, rank, use_bias=False, param_dtype=param_dtype,
                                        rngs=rngs)

  def __call__(self, h_SND, prev_SN, ids_SNK, unary_SNK) -> jax.Array:
    """float32 scores [S, N, K] of candidates `ids` (head logits `unary`) after token `prev`."""
    context_SNR = (self.predecessor_codebook[...][prev_SN].astype(jnp.float32)
                   * self.hidden_projection(h_SND).astype(jnp.float32))
    succ_SNKR = self.successor_codebook[...][ids_SNK].astype(jnp.float32)
    return unary_SNK.astype(jnp.float32) + jnp.einsum("snr,snkr->snk", context_SNR, succ_SNKR)

  def greedy_path(self, h_SLD, anchor_S, ids_SLK, unary_SLK) -> jax.Array:
    """int [S, L]: the block's tokens chosen left to right, each the best-scoring candidate
    after the one chosen before it (the anchor token before the first)."""
    def step(prev_S, xs):
      h_SD, ids_SK, unary_SK = xs
      scores = self(h_SD[:, None], prev_S[:, None], ids_SK[:, None], unary_SK[:, None])[:, 0]
      pick = jnp.take_along_axis(ids_SK, jnp.argmax(scores, -1)[:, None], -1)[:, 0]
      return pick, pick

    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), (h_SLD, ids_SLK, unary_SLK))
    return jnp.moveaxis(jax.lax.scan(step, anchor_S, xs)[1], 0, 1)
