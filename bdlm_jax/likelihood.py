"""Log-likelihoods of continuations given contexts, for every objective that scores text: what
an evaluation harness's multiple-choice and perplexity tasks ask for (bdlm_jax/harness_lm.py).

* `ar`: exact, log p(continuation | context) from `ar_logits` (the context and continuation
  in one causal row; each request its own document).
* `bd3lm`, `fast_dllm_v2`: minus the NELBO of the continuation given the clean context, as
  training scores a prompt's response: the context is `protected` (never masked, never
  scored) and ends on a block boundary (left-padded, like `sample`'s prompt), the
  continuation's blocks are noised (t per block, a uniform per position) and each masked
  token scored with weight 1/t, by the objective's `nelbo_config` and `nelbo_corrupt`:
  `bd3lm` as its held-out eval (t over [eval.t_min, 1]); `fast_dllm_v2` with both
  complementary copies, t over [eval.t_min, 1 - eval.t_min], copy 1 (masked where u < t)
  weighing 1/(2t) and copy 2 (masked where u >= t, noise level 1 - t) 1/(2(1 - t)): each
  copy an unbiased NELBO estimate, the pair antithetic. A one-token continuation's NELBO has
  expectation exactly -log p of that token masked after the context (for fast_dllm_v2 the
  clean boundary row's prediction, the sampler's for a block's first token).

Monte Carlo: `draws` fixed keys, the same for every request (a choice's score never depends
on the batch it runs in, and the choices of one question, padded to one length, share their
noise: common random numbers), each an antithetic draw over the blocks (`objective.antithetic`).
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple, Sequence

import jax
import numpy as np

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.loss import ar_forward, ar_rows
from bdlm_jax.models.transformer import head_logits
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import merge
from bdlm_jax.parallel.registry import SINGLE_DEVICE
from bdlm_jax.spec import resolve


class Scores(NamedTuple):
  """Per request: the log-likelihood (exact, or minus a NELBO estimate), its Monte Carlo
  standard error (0 when exact, NaN from one draw) and whether every continuation token is the argmax of its
  prediction (`ar`; a NELBO has no such prediction: False, the harness decides by sampling)."""

  logprob: np.ndarray  # float64 [N]
  stderr: np.ndarray  # float64 [N]
  greedy: np.ndarray  # bool [N]


def exact(cfg: Config) -> bool:
  """Whether the model's likelihood is exact, not a NELBO: a model of the clean tokens alone
  (no noisy stream: `ar`)."""
  return not get_objective(cfg.objective.name).NOISY_STREAM


def check_scored(cfg: Config) -> None:
  """Refuses objectives without a likelihood or a NELBO here (those without `nelbo_corrupt`)."""
  if not exact(cfg) and not hasattr(get_objective(cfg.objective.name), "nelbo_corrupt"):
    raise ConfigError(f"no loglikelihood for objective={cfg.objective.name} yet (exact for ar, "
                      f"a NELBO for objectives with nelbo_corrupt: bd3lm, fast_dllm_v2); "
                      f"generation tasks (generate_until) still run")


def continuation_scores(params, cfg: Config, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                        draws: int, key) -> Scores:
  """`Scores` of each (context ids, continuation ids) pair, computed together as one batch
  (callers group pairs of similar length). params on one device."""
  check_scored(cfg)
  if not pairs or any(not context or not cont for context, cont in pairs):
    raise ConfigError("every request needs a non-empty context (its first token is predicted "
                      "from it: lm-eval gives EOS to an empty one) and continuation")
  if exact(cfg):
    return _ar_scores(params, cfg, pairs)
  return _nelbo_scores(params, cfg, pairs, draws, key)


def nelbo_length(cfg: Config, context_len: int, continuation_len: int) -> int:
  """The padded row a BDLM request is scored in: the context left-padded to whole blocks,
  then the continuation's whole blocks (a function of the request alone, so its noise is)."""
  b = cfg.objective.block_size
  return (-(-context_len // b) + -(-continuation_len // b)) * b


_AR_BUCKET = 16  # AR rows are padded to a multiple: few shapes, few compiles


def padded_length(cfg: Config, context_len: int, continuation_len: int) -> int:
  """The row a request is scored in (requests of one length batch together)."""
  if exact(cfg):
    return -(-(context_len + continuation_len) // _AR_BUCKET) * _AR_BUCKET
  return nelbo_length(cfg, context_len, continuation_len)


def _ar_scores(params, cfg: Config, pairs) -> Scores:
  length = max(padded_length(cfg, len(c), len(x)) for c, x in pairs)
  tokens, seg = np.zeros((len(pairs), length), np.int32), np.zeros((len(pairs), length), np.int32)
  for i, (context, cont) in enumerate(pairs):
    row = list(context) + list(cont)
    tokens[i, :len(row)], seg[i, :len(row)] = row, 1
  ar_cfg, batch = ar_rows(cfg, tokens, seg)
  logp = np.asarray(_ar_fn(json.dumps(ar_cfg.to_dict(), sort_keys=True))(params, batch))
  out, greedy = [], []
  for i, (context, cont) in enumerate(pairs):
    rows = np.arange(len(context) - 1, len(context) + len(cont) - 1)  # row p predicts p + 1
    target = tokens[i, rows + 1]
    out.append(float(np.sum(logp[i, rows, target], dtype=np.float64)))
    greedy.append(bool(np.all(np.argmax(logp[i, rows], -1) == target)))
  return Scores(np.asarray(out), np.zeros(len(pairs)), np.asarray(greedy))


@functools.lru_cache(maxsize=16)
def _ar_fn(cfg_json: str):
  """jit (params, batch) -> log-probabilities [S, L, vocab] of `ar_forward`."""
  cfg = Config.from_dict(json.loads(cfg_json))
  return jax.jit(lambda params, batch: jax.nn.log_softmax(ar_forward(params, cfg, batch), -1))


def scoring_config(cfg: Config, seq_len: int) -> Config:
  """The objective as its NELBO scores it (`nelbo_config`), on one device, for rows of
  `seq_len` tokens."""
  objective = get_objective(cfg.objective.name).nelbo_config(cfg.objective, cfg.eval.t_min)
  return replace(cfg, objective=objective, data=dict(seq_len=seq_len),
                 parallel=dict(strategy=SINGLE_DEVICE, seq=1, data=1, fsdp=1))


def _nelbo_scores(params, cfg: Config, pairs, draws: int, key) -> Scores:
  length = max(padded_length(cfg, len(c), len(x)) for c, x in pairs)
  one = scoring_config(cfg, length)
  batches = []
  for context, cont in pairs:
    # Left-padded to the block boundary before the continuation, then right-padded.
    start = -(-len(context) // cfg.objective.block_size) * cfg.objective.block_size
    tokens = np.zeros((1, length), np.int32)
    seg, protected = np.zeros_like(tokens), np.zeros(tokens.shape, bool)
    tokens[0, start - len(context):start + len(cont)] = list(context) + list(cont)
    seg[0, start - len(context):start + len(cont)] = 1
    protected[0, start - len(context):start] = True
    batches.append(make_batch(one, tokens, seg, protected))
  stacked = jax.tree.map(lambda *x: np.stack(x), *batches)  # [N, 1, R]
  keys = jax.random.split(key, draws)
  per_draw = np.asarray(_nelbo_fn(json.dumps(one.to_dict(), sort_keys=True))(params, stacked,
                                                                               keys), np.float64)
  mean = per_draw.mean(1)
  stderr = per_draw.std(1, ddof=1) / np.sqrt(draws) if draws > 1 else np.full(len(pairs), np.nan)
  return Scores(-mean, stderr, np.zeros(len(pairs), bool))


@functools.lru_cache(maxsize=16)
def _nelbo_fn(cfg_json: str):
  """jit (params, batches [N, 1, R], keys [D]) -> NELBO [N, D] in nats, summed over each
  request's continuation."""
  cfg = Config.from_dict(json.loads(cfg_json))
  spec, objective = resolve(cfg), get_objective(cfg.objective.name)

  def one_draw(model, batch, key):
    batch2, inputs, scored, weight = objective.nelbo_corrupt(key, batch, cfg)
    hidden, _, _ = objective.hidden(spec, model, batch2, inputs, None)
    labels, scored, weight = (spec.plan.slot_rows(x, objective.LOSS_SLOT)
                              for x in (batch2.labels, scored, weight))
    logits = head_logits(model.head, hidden, cfg.model.logit_softcap, cfg.model.output_multiplier)
    return objective.score(logits, labels, scored, weight, cfg=cfg.objective)

  def nelbo(params, batches, keys):
    model = merge(cfg, params)
    per_request = lambda batch: jax.lax.map(lambda k: one_draw(model, batch, k), keys)
    return jax.vmap(per_request)(batches)

  return jax.jit(nelbo)
