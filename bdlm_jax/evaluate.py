"""Held-out evaluation: the numbers a researcher compares across runs, objectives and strategies.

* `eval_loss`, nats per held-out token, with `eval_ppl = exp(eval_loss)`:
  - `bd3lm`: the NELBO. With the linear schedule it is E_t[(1/t) * CE of the masked tokens],
    t over [eval.t_min, 1] whatever the training clip, drawn antithetically and averaged over
    `eval.noise_draws` fixed draws; an upper bound on the NLL, so `eval_ppl` bounds perplexity.
  - `ar`: the exact next-token NLL (no noise to draw) of every token but each document's
    first, which has no context to be predicted from (packing adds no BOS); bd3lm scores
    those too (1 token in ~43 on the embedded data).
  - `fast_dllm_v2`: its own training loss (no likelihood bound), averaged like bd3lm's.
  The batches and noise keys are fixed, so two evals differ only through the parameters; the
  noise is drawn in logical coordinates, so every strategy gives the same number.
* `eval_accuracy` / `eval_chance` on the embedded arithmetic data: held-out prompts "... a+b="
  completed by the model's own sampler (`sample_batch`, greedy); chance scores the same
  completions against the answers of the *other* prompts, all operators mixed: what answers
  drawn like the model's, blind to the prompt, would score. Beside them
  `eval_tokens_per_forward` (tokens revealed per denoising forward: what `sample.threshold` and
  `sample.steps_per_block` buy) and `eval_tokens_per_s` (`SampleStats`).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bdlm_jax.checkpoint import restore_state
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.objectives import get_objective
from bdlm_jax.data.arithmetic import ArithmeticSource, split_statement
from bdlm_jax.data.chat import ArithmeticChatSource, make_template, render
from bdlm_jax.feed import Feed
from bdlm_jax.loss import spec_loss
from bdlm_jax.parallel.mesh import make_mesh, row_sharding
from bdlm_jax.sample import SampleStats, checked_tokenizer, sample_batch, sampling_params
from bdlm_jax.train import state_shardings
from bdlm_jax.spec import resolve

_EVAL_KEY = 0x5EED  # folded into the seed: eval noise never reuses a training step's key


def eval_config(cfg: Config) -> Config:
  """The objective as evaluated (`evaluated` of its module: bd3lm's loss made the NELBO)."""
  overrides = get_objective(cfg.objective.name).evaluated(cfg.objective, cfg.eval.t_min)
  return replace(cfg, objective=overrides) if overrides else cfg


def noise_draws(cfg: Config) -> int:
  """Noise draws per held-out batch: one where nothing is random (no noisy stream, or a
  drafter's blocks, masked all but their anchor)."""
  objective = get_objective(cfg.objective.name)
  return cfg.eval.noise_draws if objective.NOISY_STREAM and not objective.DRAFTER else 1


def make_eval_step(cfg: Config, mesh):
  """A jitted `(params, batch, key) -> (summed token loss, valid tokens)`, the loss averaged
  over `noise_draws(cfg)` draws split from `key`."""
  spec, draws = resolve(eval_config(cfg), mesh), noise_draws(cfg)

  def eval_step(params, batch, key):
    def one_draw(k):
      _, metrics = spec_loss(spec, params, batch, k)
      loss = metrics.get("token_loss", metrics["loss"])  # without an MoE's router losses
      return loss * metrics["valid_tokens"], metrics["valid_tokens"]

    totals, counts = jax.lax.map(one_draw, jax.random.split(key, draws))
    return jnp.mean(totals), counts[0]

  replicated = NamedSharding(mesh, P())
  return jax.jit(eval_step,
                 in_shardings=(state_shardings(cfg, mesh).params, row_sharding(mesh), replicated),
                 out_shardings=replicated)


class HeldOut:
  """Fixed held-out batches and noise keys; `(params) -> metrics` evaluates them."""

  def __init__(self, cfg: Config, mesh):
    self._cfg = cfg
    # Batches of one micro-batch: what a train step holds at once.
    micro = replace(cfg, train=dict(batch_size=cfg.train.batch_size // cfg.train.grad_accum,
                                     grad_accum=1))
    feed = Feed(micro, mesh, split="eval")
    self._batches = [next(feed) for _ in range(cfg.eval.batches)]
    self._step = make_eval_step(micro, mesh)
    self._key = jax.random.fold_in(jax.random.key(cfg.seed), _EVAL_KEY)
    # (A drafter does not generate alone: experiments/dflash_tau.py measures it with its target.)
    generates = (cfg.data.source == "arithmetic" and cfg.eval.prompts
                 and not get_objective(cfg.objective.name).DRAFTER)
    self._prompts = arithmetic_prompts(cfg, cfg.eval.prompts) if generates else []

  def __call__(self, params) -> dict[str, float]:
    total, count = 0.0, 0
    for i, batch in enumerate(self._batches):
      loss, n = self._step(params, batch, jax.random.fold_in(self._key, i))
      total, count = total + float(loss), count + int(n)
    loss = total / max(count, 1)
    metrics = dict(eval_loss=loss, eval_ppl=math.exp(min(loss, 700.0)), eval_tokens=count)
    if self._prompts:
      stats = SampleStats()
      accuracy, chance, _ = arithmetic_accuracy(sampling_params(params), self._cfg,
                                                self._prompts, stats=stats)
      metrics.update(eval_accuracy=accuracy, eval_chance=chance,
                     eval_tokens_per_forward=stats.tokens_per_forward,
                     eval_tokens_per_s=stats.tokens_per_s)
    return metrics


def arithmetic_prompts(cfg: Config, n: int) -> list[tuple[str, str]]:
  """`n` held-out (prompt, answer) pairs: a held-out document up to one statement's "=" (the
  statement drawn at random), and that statement's result; for a chat model, held-out
  conversations (`data.format=chat`). A document's earlier statements are dropped, whole,
  until the prompt and its answer fit the `data.seq_len` tokens the model was trained on."""
  if cfg.data.format == "chat":
    template = make_template(cfg.data)
    chats = ArithmeticChatSource(cfg.seed, "eval", template)
    return [(render(chats.messages(i), template)[0], chats.messages(i)[-1]["content"])
            for i in range(n)]
  source = ArithmeticSource(cfg.seed, split="eval")
  tokens = lambda text: len(checked_tokenizer(cfg).encode(text))
  rng = np.random.default_rng(cfg.seed)
  pairs = []
  for i in range(n):
    statements = source[i].split(" ")
    k = int(rng.integers(len(statements)))
    question, answer = split_statement(statements[k])
    context = statements[:k]
    while context and tokens(" ".join(context + [question])) + tokens(answer) > (
        cfg.data.seq_len):
      context = context[1:]
    pairs.append((" ".join(context + [question]), answer))
  return pairs


def score_answers(completions: list[str], answers: list[str]) -> tuple[float, float]:
  """(accuracy, chance): how often completion i starts with answer i, and how often it starts
  with the answer of another prompt j != i, over all such pairs (all operators mixed): what
  answers drawn like the model's, but blind to the prompt, would score."""
  got = np.asarray([_leading_number(c) for c in completions], dtype=object)
  hits = got[:, None] == np.asarray(answers, dtype=object)[None, :]
  n = len(answers)
  return float(np.mean(np.diag(hits))), float((hits.sum() - np.trace(hits)) / max(n * (n - 1), 1))


def _leading_number(completion: str) -> str | None:
  found = re.match(r"\d+", completion)
  return found.group() if found else None


def arithmetic_accuracy(params, cfg: Config, pairs: list[tuple[str, str]], key=None,
                        stats: SampleStats | None = None) -> tuple[float, float, list[str]]:
  """(accuracy, chance, completions) of greedy completions of `pairs`' prompts (see
  `score_answers`), generated by `sample_batch` with the options of `cfg.sample`, in batches
  of `sample.max_batch` prompts of similar lengths; `stats` accumulates what they cost."""
  tokenizer = checked_tokenizer(cfg)
  key = jax.random.key(cfg.seed) if key is None else key
  longest = max(len(answer) for _, answer in pairs)
  prompts = [tokenizer.encode(prompt) for prompt, _ in pairs]
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  completions = [""] * len(prompts)
  for at in range(0, len(order), cfg.sample.max_batch):
    batch = order[at:at + cfg.sample.max_batch]
    for i, tokens in zip(batch, sample_batch(params, cfg, [prompts[i] for i in batch], key,
                                             max_new_tokens=longest + 1, temperature=0.0,
                                             eos_id=tokenizer.eos_id, stats=stats)):
      completions[i] = tokenizer.decode(tokens)
  accuracy, chance = score_answers(completions, [answer for _, answer in pairs])
  return accuracy, chance, completions


def evaluate_checkpoint(cfg: Config, workdir: str) -> tuple[int, dict[str, float]]:
  """mode=eval: (step, metrics) of checkpoint `eval.checkpoint_step` (-1: latest) of
  `workdir`, on the mesh and strategy of `cfg`."""
  mesh = make_mesh(cfg)
  step, state = restore_state(cfg, workdir, mesh, cfg.eval.checkpoint_step)
  return step, HeldOut(cfg, mesh)(state.params)


def describe(metrics: dict[str, float], objective: str) -> str:
  """One line for people: the held-out loss under its right name, and accuracy vs chance."""
  name, ppl = get_objective(objective).HELD_OUT
  extra = f"{ppl} {metrics['eval_ppl']:.2f}, " if ppl else ""
  line = (f"held-out {name} {metrics['eval_loss']:.4f} nats/token ({extra}"
          f"{int(metrics['eval_tokens'])} tokens)")
  if "eval_accuracy" in metrics:
    line += (f"; arithmetic accuracy {metrics['eval_accuracy']:.1%} "
             f"(chance {metrics['eval_chance']:.1%})")
  if "eval_tokens_per_forward" in metrics:  # rows written before it was measured lack it
    line += f", {metrics['eval_tokens_per_forward']:.2f} tokens per forward"
  return line


def show_sample(cfg: Config, workdir: str) -> str:
  """One generation from the latest checkpoint of `workdir`, prompted by `sample.prompt`
  (embedded data: by default the first statement of a held-out document, or its question
  for a chat model)."""
  from bdlm_jax.sample import sample_checkpoint
  if get_objective(cfg.objective.name).DRAFTER:
    return "(a drafter proposes blocks for its target: experiments/dflash_tau.py measures it)"
  if not (cfg.sample.prompt or cfg.sample.prompt_file):
    if cfg.data.source != "arithmetic":
      return "(set sample.prompt to see a sample here)"
    statement = ArithmeticSource(cfg.seed, split="eval")[0].split(" ")[0]
    prompt = split_statement(statement)[0] if cfg.data.format == "chat" else statement + " "
    cfg = replace(cfg, sample=dict(prompt=prompt))
  _, prompt, completion, stats = sample_checkpoint(cfg, workdir)
  return (f"sample: {prompt!r} -> {completion!r} "
          f"({stats.tokens_per_forward:.2f} tokens per forward)")
