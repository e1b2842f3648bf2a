"""The lm-eval model `bdlm_jax`: its numbers are the project's own (ar_logits' NLL, the held-out
NELBO, the sampler's prediction and generation), through lm-eval's request types, its
`simple_evaluate` and its command line on the two local arithmetic tasks."""

import copy
import dataclasses
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from bdlm_jax import ar_logits, export_hf, make_batch, make_mesh, sample  # noqa: E402
from bdlm_jax.checkpoint import Checkpointer  # noqa: E402
from bdlm_jax.config import Config  # noqa: E402
from bdlm_jax.configure import replace  # noqa: E402
from bdlm_jax.errors import ConfigError  # noqa: E402
from bdlm_jax.evaluate import eval_config  # noqa: E402
from bdlm_jax.data.chat import prompt_text  # noqa: E402
from bdlm_jax.harness_lm import BdlmLM, _chat_template  # noqa: E402
from bdlm_jax.likelihood import continuation_scores, scoring_config  # noqa: E402
from bdlm_jax.loss import spec_loss  # noqa: E402
from bdlm_jax.parallel.registry import SINGLE_DEVICE  # noqa: E402
from bdlm_jax.sample import _model_json, _steps  # noqa: E402
from bdlm_jax.spec import resolve  # noqa: E402
from bdlm_jax.train import init_state  # noqa: E402
from tests.harness_tasks.make import write_tasks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
CONTEXT, ANSWER = "3*4=12 12+7=", "19"
DRAWS = 256


def _tiny(objective: str) -> Config:
  return replace(Config(), model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      head_dim=8, d_ff=64),
                 data=dict(seq_len=32), objective=dict(name=objective, block_size=4),
                 parallel=dict(strategy=SINGLE_DEVICE))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """objective -> the workdir of a tiny model's checkpoint (random weights: these tests check
  that the harness computes the project's numbers; what a trained model scores is
  docs/evaluate.md's)."""
  out = {}
  for objective in ("ar", "bd3lm", "fast_dllm_v2"):
    cfg, workdir = _tiny(objective), str(tmp_path_factory.mktemp(objective))
    with Checkpointer(workdir, cfg, save_every=1, max_to_keep=1, async_save=False) as ckpt:
      ckpt.save(1, init_state(cfg, jax.random.key(0), make_mesh(cfg)), force=True)
      ckpt.wait()  # sealed: its checksums written
    out[objective] = workdir
  return out


@pytest.fixture(scope="module")
def models(runs):
  return {name: BdlmLM(workdir=workdir, mc_samples=DRAWS, batch_size=4)
          for name, workdir in runs.items()}


def _loglikelihood(lm, pairs):
  return lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])


def _ar_reference(lm, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
  """(log p, every token its argmax) of each (context, continuation) from one `ar_logits`
  forward of the rows, right-padded."""
  length = max(len(c) + len(x) for c, x in pairs)
  tokens, seg = np.zeros((len(pairs), length), np.int32), np.zeros((len(pairs), length), np.int32)
  for i, (c, x) in enumerate(pairs):
    tokens[i, :len(c) + len(x)], seg[i, :len(c) + len(x)] = c + x, 1
  logp = np.asarray(jax.nn.log_softmax(ar_logits(lm.params, lm.cfg, tokens, seg)))
  out = []
  for i, (c, x) in enumerate(pairs):
    rows = np.arange(len(c) - 1, len(c) + len(x) - 1)
    out.append((float(np.sum(logp[i, rows, x])), bool(np.all(np.argmax(logp[i, rows], -1) == x))))
  return out


def test_ar_loglikelihood_is_ar_logits_nll_and_greedy_its_argmax(models):
  lm = models["ar"]
  pairs = [(CONTEXT, ANSWER), ("5-", "2=3"), ("", "7*7=49")]
  ids = [(lm.tok_encode(c) if c else [lm.eot_token_id], lm.tok_encode(x)) for c, x in pairs]
  for (logprob, greedy), (want, want_greedy) in zip(_loglikelihood(lm, pairs),
                                                    _ar_reference(lm, ids)):
    assert logprob == pytest.approx(want, abs=1e-4)
    assert greedy == want_greedy


def test_ar_rolling_loglikelihood_sums_windows_of_the_context_length(models):
  """A text of 72 tokens through a 32-token model: disjoint windows of 31 tokens, each given
  the tokens before it that fill the window (one; EOS for the first; 22 for the last, of 10),
  as lm-eval's own models roll (context_len 1)."""
  lm, text = models["ar"], "1+1=2 " * 12
  tokens, width = lm.tok_encode(text), lm.max_length - 1
  windows = [([lm.eot_token_id] if i == 0 else tokens[i + len(tokens[i:i + width]) - width - 1:i],
              tokens[i:i + width]) for i in range(0, len(tokens), width)]
  got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
  assert len(windows) == 3
  assert got[0] == pytest.approx(sum(lp for lp, _ in _ar_reference(lm, windows)), abs=1e-3)


def test_a_bdlm_rolls_a_short_text_as_one_request_after_eos(models):
  lm, text = models["fast_dllm_v2"], "1+1=2 3*3=9"
  rolled = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
  assert rolled == pytest.approx(_loglikelihood(lm, [("", text)])[0][0], rel=1e-5)


def _nelbo_row(lm, context: list[int], cont: list[int], objective: dict):
  """(config, batch) of the row the harness scores (context protected, ending on a block
  boundary), under `scoring_config` with `objective` overrides, built here."""
  b = lm.cfg.objective.block_size
  start = -(-len(context) // b) * b
  length = start + -(-len(cont) // b) * b
  one = replace(scoring_config(lm.cfg, length), objective=objective)
  tokens, seg = np.zeros((1, length), np.int32), np.zeros((1, length), np.int32)
  tokens[0, start - len(context):start + len(cont)] = context + cont
  seg[0, start - len(context):start + len(cont)] = 1
  return one, make_batch(one, tokens, seg, (np.arange(length) < start)[None])


def _fully_masked_logprob(lm, context: list[int], token: int) -> float:
  """bd3lm: log p of a one-token continuation with it masked (t = 1: the training loss of
  that row is exactly its cross-entropy)."""
  one, batch = _nelbo_row(lm, context, [token], dict(eps_min=1.0, eps_max=1.0))
  return -float(spec_loss(resolve(one), lm.params, batch, jax.random.key(0))[0])


def _sampler_logprob(lm, context: list[int], token: int) -> float:
  """fast_dllm_v2: log p of a one-token continuation as the sampler predicts a block's first
  token, from the clean row before the block (token shift), [MASK] logit removed."""
  cfg, b = lm.cfg, lm.cfg.objective.block_size
  first = -(-len(context) // b) * b
  ctx, seg = np.zeros((1, first + b), np.int32), np.zeros((1, first + b), np.int32)
  ctx[0, first - len(context):first], seg[0, first - len(context):first] = context, 1
  block = jnp.full((1, b), cfg.objective.mask_token_id, jnp.int32)
  _, prev = _steps(_model_json(cfg)).denoise_full(lm.params, ctx, seg, block, first,
                                                  np.zeros((1, 1), np.int32))
  prev = prev[0]  # [N, vocab] now: one row here
  return float(jax.nn.log_softmax(prev.at[cfg.objective.mask_token_id].set(-jnp.inf))[token])


@pytest.mark.parametrize("objective,reference", [("bd3lm", _fully_masked_logprob),
                                                 ("fast_dllm_v2", _sampler_logprob)])
def test_a_one_token_nelbo_estimates_its_exact_log_probability(models, objective, reference):
  """A continuation of one token: its NELBO's expectation is exactly -log p of the token
  masked (bd3lm) or of the sampler's prediction from the clean context (fast_dllm_v2); the
  estimate is within its Monte Carlo error."""
  lm = models[objective]
  context = lm.tok_encode(CONTEXT)
  token = lm.tok_encode("1")[0]
  scores = lm._scores([(context, [token])])
  want = reference(lm, context, token)
  assert abs(scores.logprob[0] - want) < 4 * scores.stderr[0], (scores, want)
  assert 0 < scores.stderr[0] < 0.3 * abs(want)


def test_bd3lm_loglikelihood_is_minus_the_held_out_nelbo_of_the_continuation(models):
  """The harness's estimate is the held-out eval's NELBO (spec_loss under eval_config) of the
  protected-context row, draw for draw on the same keys; on other keys, within the Monte
  Carlo errors."""
  lm = models["bd3lm"]
  context, cont = lm.tok_encode(CONTEXT), lm.tok_encode(ANSWER + " 5+5=10")
  scores = lm._scores([(context, cont)])
  one, batch = _nelbo_row(lm, context, cont, dataclasses.asdict(eval_config(lm.cfg).objective))
  spec = resolve(one)
  draw = jax.jit(lambda key: spec_loss(spec, lm.params, batch, key)[1])

  def nelbos(keys):
    out = []
    for key in keys:
      metrics = draw(key)
      assert int(metrics["valid_tokens"]) == len(cont)
      out.append(float(metrics["loss"] * metrics["valid_tokens"]))
    return np.asarray(out)

  same = nelbos(jax.random.split(jax.random.key(lm.seed), DRAWS))
  assert -scores.logprob[0] == pytest.approx(np.mean(same), rel=1e-4)
  other = nelbos(jax.random.split(jax.random.key(1000), DRAWS))
  error = np.std(other) / np.sqrt(DRAWS)
  assert abs(-scores.logprob[0] - np.mean(other)) < 4 * np.hypot(scores.stderr[0], error)
  assert scores.stderr[0] == pytest.approx(np.std(same, ddof=1) / np.sqrt(DRAWS), rel=1e-3)


def test_a_request_scores_the_same_in_any_batch(models):
  lm = models["fast_dllm_v2"]
  pairs = [(lm.tok_encode(CONTEXT), lm.tok_encode(ANSWER)), (lm.tok_encode("1+1="), [50])]
  alone = lm._scores(pairs[:1]).logprob[0]
  assert lm._scores(pairs).logprob[0] == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("objective", ["ar", "fast_dllm_v2"])
def test_generation_is_samples_cut_at_the_stop_strings(models, objective):
  """Each context's `sample` (greedy, max_gen_toks tokens), cut at a stop string taken from
  the middle of that very generation, so the cut happens."""
  lm = models[objective]
  contexts = [CONTEXT, "2*2=4 7-"]
  full = [lm.tok_decode(sample(lm.params, lm.cfg, lm.tok_encode(c), jax.random.key(0),
                               max_new_tokens=6, temperature=0.0)) for c in contexts]
  stops = [[text[3:5], "never written"] for text in full]
  got = lm.generate_until([Instance("generate_until", {}, (c, dict(until=stop, max_gen_toks=6)), i)
                           for i, (c, stop) in enumerate(zip(contexts, stops))])
  for text, whole, stop in zip(got, full, stops):
    assert len(whole) >= 5 and text == whole[:whole.index(stop[0])]


@pytest.mark.slow
def test_the_local_tasks_run_through_simple_evaluate_with_the_models_numbers(models, tmp_path,
                                                                            monkeypatch):
  """lm-eval's own evaluation of the two local tasks, offline: its logged likelihoods are
  ar_logits' and its generations `sample`'s."""
  for name, value in OFFLINE.items():
    monkeypatch.setenv(name, value)
  lm = models["ar"]
  tasks = write_tasks(str(tmp_path), 4, 24)
  out = simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(tmp_path)),
                        log_samples=True, bootstrap_iters=0)
  assert set(out["results"]) == set(tasks)
  requests = [(args, doc["resps"][i][0][0]) for doc in out["samples"]["arith_mc"]
              for i, args in enumerate(doc["arguments"])]
  want = _ar_reference(lm, [(lm.tok_encode(c), lm.tok_encode(x)) for (c, x), _ in requests])
  assert len(requests) == 4 * 4
  for (_, got), (logprob, _) in zip(requests, want):
    assert float(got) == pytest.approx(logprob, abs=1e-4)
  for doc in out["samples"]["arith_gen"]:
    tokens = sample(lm.params, lm.cfg, lm.tok_encode(doc["doc"]["prompt"]), jax.random.key(0),
                    max_new_tokens=4, temperature=0.0)
    assert doc["resps"][0][0] == lm.tok_decode(tokens).split(" ")[0]


def test_a_hugging_face_folder_scores_as_the_run_it_was_exported_from(models, tmp_path):
  lm = models["ar"]
  export_hf(jax.tree.map(jnp.asarray, lm.params), lm.cfg, str(tmp_path / "hf"))
  folder = BdlmLM(workdir=str(tmp_path / "hf"))
  assert folder.cfg.objective.name == lm.cfg.objective.name
  pairs = [(CONTEXT, ANSWER)]
  assert _loglikelihood(folder, pairs)[0][0] == pytest.approx(_loglikelihood(lm, pairs)[0][0],
                                                              abs=1e-5)


def test_a_workdir_without_a_checkpoint_is_refused_in_one_line(tmp_path, runs):
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    BdlmLM(workdir=str(tmp_path))
  with pytest.raises(ConfigError, match="has no checkpoint of step=7 .the latest is 1"):
    BdlmLM(workdir=runs["ar"], step=7)


def test_a_chat_template_for_a_plain_text_model_is_refused(models):
  with pytest.raises(ConfigError, match="has none: run without --apply_chat_template"):
    models["ar"].apply_chat_template([dict(role="user", content="1+1=")])


def test_a_chat_models_template_renders_the_tasks_prompt_as_sampling_does(models):
  """A model trained on chat data (data.format=chat) renders the harness's messages with its
  data.chat_template, the prompt `sample_checkpoint` gives it."""
  lm = copy.copy(models["ar"])
  lm.cfg = replace(lm.cfg, data=dict(format="chat", chat_template="chatml"))
  lm.template = _chat_template(lm.cfg)
  assert lm.apply_chat_template([dict(role="user", content="12+7=")]) == prompt_text(
      "12+7=", "chatml")
  assert lm.chat_template(True) == "chatml"


def test_a_context_longer_than_the_model_is_refused_naming_both_lengths(models):
  lm = models["fast_dllm_v2"]
  with pytest.raises(ConfigError, match="takes 36 positions, more than the model's context of 32"):
    _loglikelihood(lm, [("1+1=2 " * 5, "2")])
  with pytest.raises(ConfigError, match="more than the model's context of 32"):
    lm.generate_until([Instance("generate_until", {}, ("1+1=2 " * 6, dict(until=[" "])), 0)])


def test_an_objective_without_a_likelihood_is_refused_in_one_line():
  cfg = replace(Config(), objective=dict(name="diffusiongemma", loss_weight="unit",
                                         self_condition_p=0.0))
  with pytest.raises(ConfigError, match="no loglikelihood for objective=diffusiongemma yet"):
    continuation_scores(None, cfg, [([1], [2])], 1, jax.random.key(0))


def test_unknown_model_args_are_refused_naming_them(runs):
  with pytest.raises(ConfigError, match=r"unknown model_args \['steps'\]"):
    BdlmLM(workdir=runs["ar"], steps=3)


@pytest.mark.slow
def test_the_command_line_scores_the_local_tasks_offline(runs, tmp_path):
  """`python -m bdlm_jax.harness` (lm-eval's CLI) with the tasks' folder, offline; a run
  without a checkpoint fails in one line."""
  tasks = ",".join(write_tasks(str(tmp_path / "tasks"), 4, 24))
  env = dict(os.environ, **OFFLINE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  base = [sys.executable, "-m", "bdlm_jax.harness", "--model", "bdlm_jax", "--tasks", tasks,
          "--include_path", str(tmp_path / "tasks"), "--batch_size", "4"]
  out = subprocess.run(base + ["--model_args", f"workdir={runs['fast_dllm_v2']},mc_samples=2",
                               "--output_path", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = json.load(open(glob.glob(str(tmp_path / "out" / "**" / "results_*.json"),
                                     recursive=True)[0]))["results"]
  assert 0 <= results["arith_mc"]["acc,none"] <= 1
  assert 0 <= results["arith_gen"]["exact_match,none"] <= 1
  empty = tmp_path / "empty"
  empty.mkdir()
  out = subprocess.run(base + ["--model_args", f"workdir={empty}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith("bdlm_jax harness: workdir=")
