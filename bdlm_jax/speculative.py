"""Speculative decoding with a DFlash drafter (docs/train_dflash.md, "Speculative decoding"):
the drafter proposes a block from the target's features, the target checks it in one forward,
the longest prefix the target agrees with is kept with the target's own next token, and the
next block is drafted from that forward's features. The output is the target's greedy
decoding, token for token; what the drafter buys is fewer target forwards.

Lossless by construction: a proposal is kept only where it equals the target's argmax after
the tokens before it, and the token after the kept prefix is the target's. The target runs
without a cache over the whole sequence so far (one jitted program at `data.seq_len`), so a
forward here costs what it costs; what is counted is forwards, the figure a serving stack's
speed-up follows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.drafting import proposer
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.drafter import FROZEN, TRAINED, target_layer_ids
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import merge_transformer, shared_weights
from bdlm_jax.parallel.registry import SINGLE_DEVICE
from bdlm_jax.spec import resolve

# What `drafter.features` says while the drafter reads the features this module hands it
IN_MEMORY = "(the target's features, in memory)"


@dataclasses.dataclass
class Decoded:
  """Generated tokens (the prompt excluded) and what the drafter bought: `accepted[i]`
  proposals kept at verification i (each verification also yields the target's token)."""
  tokens: list[int]
  target_forwards: int
  accepted: list[int]

  @property
  def acceptance_length(self) -> float:
    """Tokens a verification yields, kept proposals + the target's own (DFlash's tau)."""
    return float(np.mean(self.accepted)) + 1 if self.accepted else 0.0

  @property
  def tokens_per_forward(self) -> float:
    return len(self.tokens) / self.target_forwards

  def describe(self) -> str:
    return (f"speculative decoding: tau {self.acceptance_length:.3f} (kept proposals + the "
            f"target's token a verification), {self.tokens_per_forward:.3f} tokens per target "
            f"forward ({len(self.tokens)} tokens, {self.target_forwards} forwards)")


class Speculator:
  """A drafter run's target and drafter on one device: `greedy` (the target alone) and
  `decode` (drafted and verified) over sequences of up to `data.seq_len` tokens."""

  def __init__(self, params, cfg: Config, selector: bool | None = None):
    if not get_objective(cfg.objective.name).DRAFTER:
      raise ConfigError(f"speculative decoding needs a drafter run; objective="
                        f"{cfg.objective.name!r} trains none")
    if cfg.drafter.features:
      raise ConfigError(f"speculative decoding runs the target, whose layers a run with "
                        f"drafter.features={cfg.drafter.features!r} does not hold: set "
                        f"drafter.features='' and drafter.target to the target")
    one = replace(cfg, parallel=dict(strategy=SINGLE_DEVICE, seq=1, data=1, fsdp=1))
    self.cfg, self.length = one, one.data.seq_len
    self.block = one.objective.block_size
    self.reader = replace(one, drafter=dict(features=IN_MEMORY),  # the drafter, fed features
                          train=dict(eval_every=0))
    self.causal = replace(one, objective=dict(name="ar"))  # the target alone
    self.target_params = params[FROZEN]
    self.draft_params = {TRAINED: params[TRAINED], FROZEN: shared_weights(params[FROZEN])}
    self._propose = proposer(self.reader, selector)
    attend, layers = resolve(self.causal).attend["all"], target_layer_ids(one)

    @jax.jit
    def forward(target_params, batch):
      model = merge_transformer(one.model, target_params)
      feats, final = model.features(batch.tokens, batch.pos, batch.meta, attend, layers,
                                    one.model.n_layers)
      return feats[0], jnp.argmax(model.logits(final)[0], -1)

    self._forward = forward

  def _target(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(the target's features [L, K, D], its argmax next token at each position [L]) over
    `tokens`, padded to `data.seq_len`."""
    n = len(tokens)
    ids, seg = np.zeros((1, self.length), np.int64), np.zeros((1, self.length), np.int32)
    ids[0, :n], seg[0, :n] = tokens, 1
    feats, next_ids = self._forward(self.target_params, make_batch(self.causal, ids, seg))
    return np.asarray(feats), np.asarray(next_ids)

  def _draft(self, tokens: list[int], feats: np.ndarray) -> list[int]:
    """The drafter's B - 1 proposals after `tokens`: its block anchored at the last token,
    whose context is the target's features before it."""
    n = len(tokens)
    ids, seg = np.zeros((1, self.length), np.int64), np.zeros((1, self.length), np.int32)
    ids[0, :n], seg[0, :n + 1] = tokens, 1  # position n: a stand-in, so n - 1 may anchor
    protected = np.ones((1, self.length), bool)
    protected[0, n - 1:n + 1] = False  # the only anchor candidate: n - 1
    batch = make_batch(self.reader, ids, seg, protected, feats[None])
    assert batch.pos[0, 0] == n - 1, "the drafted block is not anchored at the last token"
    return [int(t) for t in np.asarray(self._propose(self.draft_params, batch))[0, 0]]

  def _check_room(self, prompt: list[int], max_new_tokens: int) -> None:
    need = len(prompt) + max_new_tokens + self.block
    if not prompt or need > self.length:
      raise ConfigError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones need "
                        f"data.seq_len >= {need} (got {self.length}) and a non-empty prompt")

  def greedy(self, prompt: list[int], max_new_tokens: int) -> Decoded:
    """The target's own greedy decoding: one forward a token."""
    self._check_room(prompt, max_new_tokens)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
      tokens.append(int(self._target(tokens)[1][len(tokens) - 1]))
    return Decoded(tokens[len(prompt):], max_new_tokens, [])

  def decode(self, prompt: list[int], max_new_tokens: int) -> Decoded:
    """Drafted and verified: the target's greedy tokens in fewer forwards."""
    self._check_room(prompt, max_new_tokens)
    feats, next_ids = self._target(list(prompt))
    tokens, forwards, accepted = [*prompt, int(next_ids[len(prompt) - 1])], 1, []
    while len(tokens) - len(prompt) < max_new_tokens:
      n = len(tokens)
      proposed = self._draft(tokens, feats)
      feats, next_ids = self._target(tokens + proposed)
      forwards += 1
      kept = 0
      while kept < len(proposed) and proposed[kept] == next_ids[n - 1 + kept]:
        kept += 1
      tokens += proposed[:kept] + [int(next_ids[n - 1 + kept])]
      accepted.append(kept)
    return Decoded(tokens[len(prompt):len(prompt) + max_new_tokens], forwards, accepted)


def sample_checkpoint(cfg: Config, workdir: str) -> tuple[int, str, str, Decoded]:
  """mode=sample for a drafter run: (step, prompt, completion, what the decoding did) of
  `sample.prompt` (or the text of `sample.prompt_file`) decoded speculatively with checkpoint
  `sample.checkpoint_step` of `workdir` and its target, greedy, up to the first EOS."""
  from bdlm_jax.checkpoint import restore_state
  from bdlm_jax.parallel.mesh import make_mesh, to_host
  from bdlm_jax.sample import checked_tokenizer, given_prompt, stop_ids
  o = cfg.sample
  if o.temperature:
    raise ConfigError("mode=sample with a drafter decodes greedily: set sample.temperature=0")
  prompt = given_prompt(cfg)
  tokenizer = checked_tokenizer(cfg)
  step, state = restore_state(cfg, workdir, make_mesh(cfg), o.checkpoint_step)
  params = jax.tree.map(to_host, state.params)
  out = Speculator(params, cfg).decode(tokenizer.encode(prompt), o.max_new_tokens)
  stops = [i for i, t in enumerate(out.tokens) if t in stop_ids(cfg)]
  tokens = out.tokens[:stops[0] + 1] if stops else out.tokens
  return step, prompt, tokenizer.decode(tokens), out
