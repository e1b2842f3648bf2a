"""A drafter's proposals (docs/dflash.md): the tokens it offers its target at each anchor,
greedy from the head, or through DFlash2's candidate selector (`models/selector.py`).

A drafter does not generate alone: speculative decoding (`bdlm_jax/speculative.py`) runs its
proposals past the target, and `experiments/dflash_tau.py` measures their acceptance length.
"""

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.transformer import head_logits
from bdlm_jax.params import merge
from bdlm_jax.parallel.registry import SINGLE_DEVICE
from bdlm_jax.spec import resolve


def draft_proposals(params, cfg: Config, tokens, segment_ids=None, protected=None,
                    selector: bool | None = None, context=None):
  """(int [S, A, B - 1] proposals for slots 1..B-1 of each anchor's block, the `Batch` of
  its logical rows), on one device, at the anchors `make_batch` draws for `tokens` without a
  key (seeded by the tokens: the same every call).

  `selector` (default: when the drafter has one, `objective.selector_rank` > 0) decodes
  each block left to right with the selector over the head's top `objective.selector_top_k`
  (the seed's `CandidateSelector.greedy_path`, dflash2.py ~450-470; the anchor token is the
  first predecessor); without it, each slot takes the head's argmax. `context`: the target's
  features [S, L, K, D] where the drafter reads them precomputed (`drafter.features`)."""
  one = replace(cfg, parallel=dict(strategy=SINGLE_DEVICE, seq=1, data=1, fsdp=1))
  batch = make_batch(one, np.asarray(tokens), segment_ids, protected, context)
  return proposer(one, selector)(params, batch), batch


def proposer(cfg: Config, selector: bool | None = None):
  """The jitted `(params, batch) -> int [S, A, B - 1]` of `draft_proposals`, for a
  single-device `cfg` and batches of its layout (built once, called per batch)."""
  o = cfg.objective
  selector = bool(o.selector_rank) if selector is None else selector
  if selector and not o.selector_rank:
    raise ConfigError("draft_proposals(selector=True) needs a drafter with a candidate "
                      "selector (objective.selector_rank > 0)")
  spec, b = resolve(cfg), o.block_size

  @jax.jit
  def run(params, batch):
    s = batch.tokens.shape[0]
    model = merge(cfg, params)
    batch, inputs, _, _ = spec.objective.corrupt(None, batch, cfg)
    hidden, _, _ = spec.objective.hidden(spec, model, batch, inputs, None)
    h_SABD = hidden.reshape(s, -1, b, hidden.shape[-1])[:, :, 1:]
    logits = head_logits(model.head, h_SABD, cfg.model.logit_softcap,
                         cfg.model.output_multiplier)
    if not selector:
      return jnp.argmax(logits, -1)
    unary, ids = jax.lax.top_k(logits, o.selector_top_k)
    anchor_SA = batch.tokens[:, :hidden.shape[1]].reshape(s, -1, b)[:, :, 0]
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    path = model.drafter.selector.greedy_path(flat(h_SABD), flat(anchor_SA), flat(ids),
                                              flat(unary))
    return path.reshape(s, -1, b - 1)

  return run
