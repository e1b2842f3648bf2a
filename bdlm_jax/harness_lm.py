"""`BdlmLM`, the lm-evaluation-harness model `bdlm_jax`: a trained run (or a Hugging Face
folder) answering the harness's three request types through the project's own code.

* `generate_until`: `sample` (the run's `sample.*` options, greedy unless the task samples),
  requests grouped by their generation options and by length, cut at the task's `until`
  strings; EOS stops generation.
* `loglikelihood` / `loglikelihood_rolling`: `likelihood.continuation_scores`: exact for
  `ar`, minus a Monte Carlo NELBO (`mc_samples` draws) for bd3lm and fast_dllm_v2. `is_greedy`
  of a BDLM: greedy `sample` from the context (the run's decoding options, temperature 0)
  writes the continuation's tokens first; for `ar`, every continuation token is its argmax.

docs/evaluate.md says what each number is. Here so that `python -m bdlm_jax.harness` can
import it: a class registered in the `-m` module itself would register twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from bdlm_jax.config import Config, SampleConfig
from bdlm_jax.configure import override, replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.likelihood import (check_scored, continuation_scores, exact, nelbo_length,
                                 padded_length)
from bdlm_jax.sample import checked_tokenizer, sample_batch

MODEL_NAME = "bdlm_jax"
_SAMPLE_KEYS = {f.name for f in dataclasses.fields(SampleConfig)}
_IGNORED = ("device", "max_batch_size")  # harness-wide arguments that do not apply here


def generate(params, cfg: Config, prompts: Sequence[np.ndarray], key, **options) -> list:
  """Tokens generated after each prompt (int32 arrays), `sample_batch` at most
  `sample.max_batch` prompts at a time: each as `sample` would write it alone."""
  n = cfg.sample.max_batch
  return [out for i in range(0, len(prompts), n)
          for out in sample_batch(params, cfg, prompts[i:i + n], key, **options)]


def load_run(workdir: str, step: int = -1, overrides: Sequence[str] = ()) -> tuple:
  """(cfg, params on one device, step) of checkpoint `step` (-1: latest) of a run's workdir,
  under the config it was saved with, or of a Hugging Face folder (step None) whose
  config.json records `bdlm_objective` (else the objective defaults); `overrides` (`a.b=c`)
  change what does not touch the params (sample.*, eval.t_min...)."""
  from bdlm_jax.checkpoint import Checkpointer, restore_state
  from bdlm_jax.parallel.mesh import make_mesh, to_host
  from bdlm_jax.parallel.registry import SINGLE_DEVICE
  one_device = dict(strategy=SINGLE_DEVICE, seq=1, data=1, fsdp=1)
  if not os.path.isdir(workdir):
    raise ConfigError(f"workdir={workdir!r} does not exist")
  if os.path.isfile(os.path.join(workdir, "config.json")):
    from bdlm_jax.checkpoint.hf_import import import_hf, read_hf_config
    cfg, params = import_hf(workdir)
    name = read_hf_config(workdir).get("bdlm_objective")
    cfg = replace(cfg, objective=dict(name=name) if name else {}, parallel=one_device)
    return override(cfg, overrides), jax.tree.map(to_host, params), None
  with Checkpointer(workdir, Config(), save_every=1, max_to_keep=1, async_save=False) as ckpt:
    latest = ckpt.latest_step()
    if latest is None:
      raise ConfigError(f"workdir={workdir!r} holds no checkpoint (train it first, or point "
                        f"workdir at a run's folder or a Hugging Face folder)")
    if step >= 0 and not ckpt.step_dir(step).exists():
      raise ConfigError(f"workdir={workdir!r} has no checkpoint of step={step} (the latest is "
                        f"{latest}; step=-1 takes it)")
    saved = ckpt.saved_config(latest if step < 0 else step)
  cfg = override(replace(Config.from_dict(saved), parallel=one_device), overrides)
  found, state = restore_state(cfg, workdir, make_mesh(cfg), step)
  return cfg, jax.tree.map(to_host, state.params), found


def _chat_template(cfg: Config):
  """The template the model was trained with: a chat run's `data.chat_template`, or an
  imported folder's own; None for a model trained on plain text."""
  from bdlm_jax.data.chat import FOLDER, make_template
  if cfg.data.format == "chat" or cfg.data.chat_template == FOLDER:
    return make_template(cfg.data)
  return None


@register_model(MODEL_NAME)
class BdlmLM(TemplateLM):
  """model_args: workdir (a run, or a Hugging Face folder), step (-1: latest), mc_samples
  (NELBO draws per request), seed, max_length (tokens of context + continuation; default
  data.seq_len), and any sample.* option, bare or dotted (steps_per_block=2,
  sample.strategy=first_hitting); batch_size: requests scored together."""

  def __init__(self, workdir: str, step: int = -1, mc_samples: int = 32, seed: int = 0,
               max_length: int | None = None, batch_size: int | str = 16, **options):
    super().__init__()
    unknown = [k for k in options if k not in _IGNORED and k.removeprefix("sample.")
               not in _SAMPLE_KEYS]
    if unknown:
      raise ConfigError(f"unknown model_args {unknown}: expected workdir, step, mc_samples, seed, "
                        f"max_length, batch_size or sample.* options ({sorted(_SAMPLE_KEYS)})")
    sets = [f"sample.{k.removeprefix('sample.')}={v}" for k, v in options.items()
            if k not in _IGNORED]
    self.cfg, self.params, self.step = load_run(workdir, int(step), sets)
    if int(mc_samples) < 1:
      raise ConfigError(f"mc_samples must be >= 1, got {mc_samples}")
    self.mc_samples, self.seed = int(mc_samples), int(seed)
    self.max_length = int(max_length or self.cfg.data.seq_len)
    self.batch_size = 16 if str(batch_size).startswith("auto") else max(int(batch_size), 1)
    self.tokenizer_ = checked_tokenizer(self.cfg)
    self.template = _chat_template(self.cfg)

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer_.eos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    return self.tokenizer_.encode(string)

  def tok_decode(self, tokens) -> str:
    return self.tokenizer_.decode([int(t) for t in tokens])

  @property
  def tokenizer_name(self) -> str:
    return str(self.cfg.data.tokenizer).replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if not chat_template:
      return None
    template = self._require_template()
    return getattr(template, "text", template)

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
    from bdlm_jax.data.chat import FolderTemplate, render
    template = self._require_template()
    if isinstance(template, FolderTemplate):
      return template(chat_history, add_generation_prompt=add_generation_prompt)
    if add_generation_prompt:
      return render(list(chat_history) + [dict(role="assistant", content="")], template)[0]
    return "".join(render(chat_history, template))  # the assistant's prefilled start

  def _require_template(self):
    if self.template is None:
      raise ConfigError(f"the task asks for a chat template (--apply_chat_template), but this "
                        f"model was trained on plain text (data.format={self.cfg.data.format!r}) "
                        f"and has none: run without --apply_chat_template")
    return self.template

  # -- loglikelihood ---------------------------------------------------------------------------

  def _row_length(self, context_len: int, continuation_len: int) -> int:
    """Positions a request takes: context + continuation, for a BDLM each padded to whole
    blocks (the context ends on a block boundary, as a prompt does in `sample`)."""
    if exact(self.cfg):
      return context_len + continuation_len
    return nelbo_length(self.cfg, context_len, continuation_len)

  def _check_length(self, n: int, what: str) -> None:
    if n > self.max_length:
      raise ConfigError(f"{what} takes {n} positions, more than the model's context of "
                        f"{self.max_length} (the data.seq_len it was trained at; max_length=N "
                        f"in --model_args allows more)")

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    pairs = [(list(context), list(cont)) for _, context, cont in requests]
    for (context, cont), (strings, _, _) in zip(pairs, requests):
      self._check_length(self._row_length(len(context), len(cont)),
                         f"the request {strings[0][-40:]!r} + {strings[1][:40]!r}")
    scores = self._scores(pairs)
    if exact(self.cfg):
      greedy = scores.greedy
    else:
      made = self._greedy_generations(pairs)
      greedy = [made[tuple(context)][:len(cont)].tolist() == cont for context, cont in pairs]
    out = [(float(lp), bool(g)) for lp, g in zip(scores.logprob, greedy)]
    for (strings, _, _), result in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood", strings, result)
    return out

  def _scores(self, pairs: list[tuple[list[int], list[int]]]):
    """`continuation_scores` of `pairs`, in batches of `batch_size` requests of one padded
    length (`padded_length`, longest first), returned in the order given."""
    from bdlm_jax.likelihood import Scores
    check_scored(self.cfg)
    length = lambda context, cont: padded_length(self.cfg, len(context), len(cont))
    order = sorted(range(len(pairs)), key=lambda i: -length(*pairs[i]))
    logprob, stderr, greedy = (np.zeros(len(pairs)), np.zeros(len(pairs)),
                               np.zeros(len(pairs), bool))
    key = jax.random.key(self.seed)
    start = 0
    while start < len(order):
      same = [i for i in order[start:start + self.batch_size]
              if length(*pairs[i]) == length(*pairs[order[start]])]
      # every batch full (the first request repeated): one compile per padded length
      batch = [pairs[i] for i in same] + [pairs[same[0]]] * (self.batch_size - len(same))
      got = continuation_scores(self.params, self.cfg, batch, self.mc_samples, key)
      logprob[same], stderr[same], greedy[same] = (x[:len(same)] for x in got)
      start += len(same)
    return Scores(logprob, stderr, greedy)

  def _greedy_generations(self, pairs) -> dict[tuple[int, ...], np.ndarray]:
    """Greedy generation from each distinct context of `pairs`, as long as its longest
    continuation (a BDLM's `is_greedy`): contexts grouped by that length, `batch_size` at a
    time."""
    longest: dict[tuple[int, ...], int] = {}
    for context, cont in pairs:
      longest[tuple(context)] = max(longest.get(tuple(context), 0), len(cont))
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for context, n in longest.items():
      by_length.setdefault(n, []).append(context)
    made = {}
    for n, contexts in by_length.items():
      for start in range(0, len(contexts), self.batch_size):
        chunk = contexts[start:start + self.batch_size]
        tokens = generate(self.params, self.cfg, [np.asarray(c, np.int32) for c in chunk],
                          jax.random.key(self.seed), max_new_tokens=n, temperature=0.0)
        made.update(zip(chunk, tokens))
    return made

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """The whole text's log-likelihood, in windows of max_length tokens (each scored given
    the previous tokens that fit), as lm-eval's own models compute it."""
    # a window's context and continuation fit max_length once padded to whole blocks
    padding = 0 if exact(self.cfg) else 2 * (self.cfg.objective.block_size - 1)
    width = self.max_length - 1 - padding
    windows, owner = [], []
    for i, (text,) in enumerate(req.args for req in requests):
      tokens = self.tok_encode(text)
      rolling = get_rolling_token_windows(tokens, self.prefix_token_id, width, 1)
      for context, cont in map(make_disjoint_window, rolling):
        windows.append((context, cont))
        owner.append(i)
    scores = self._scores(windows).logprob
    totals = np.zeros(len(requests))
    np.add.at(totals, owner, scores)
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
    return [float(t) for t in totals]

  # -- generation ------------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(self._options(req.args[1]), sort_keys=True), []).append(i)
    out = [""] * len(requests)
    for options_json, members in groups.items():
      options = json.loads(options_json)
      until = options.pop("until")
      prompts = [np.asarray(self.tok_encode(requests[i].args[0]), np.int32) for i in members]
      for i, prompt in zip(members, prompts):
        if not prompt.size:
          raise ConfigError(f"request {i} has an empty context: nothing to generate from")
        self._check_length(prompt.size, f"the context of request {i} "
                           f"({requests[i].args[0][-40:]!r})")
      by_length = sorted(range(len(members)), key=lambda k: -prompts[k].size)
      for start in range(0, len(by_length), self.batch_size):
        chunk = by_length[start:start + self.batch_size]
        made = generate(self.params, self.cfg, [prompts[k] for k in chunk],
                        jax.random.key(self.seed), **options)
        for k, tokens in zip(chunk, made):
          text = self.tok_decode(tokens)
          out[members[k]] = _cut(text, until)
          self.cache_hook.add_partial("generate_until", requests[members[k]].args,
                                      out[members[k]])
    return out

  def _options(self, gen_kwargs: dict) -> dict:
    """`sample` options of one request: max_gen_toks, greedy unless it samples, its stop
    strings (EOS stops anyway)."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    options = dict(max_new_tokens=int(kwargs.pop("max_gen_toks", self.cfg.sample.max_new_tokens)),
                   until=until)
    if kwargs.pop("do_sample", False) or float(kwargs.get("temperature") or 0.0) > 0:
      options["temperature"] = float(kwargs.get("temperature") or 1.0)
    else:
      options["temperature"] = 0.0
    return options


def _cut(text: str, until: Sequence[str]) -> str:
  """`text` up to the first of the stop strings."""
  for stop in until:
    if stop:
      text = text.split(stop, 1)[0]
  return text
