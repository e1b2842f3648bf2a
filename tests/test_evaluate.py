"""Held-out evaluation: one number under every strategy, the right value on a model whose
answer is known, a held-out split that training never reads, and chance that is measured."""

import json
import math

import grain
import jax
import numpy as np
import pytest

import run
from bdlm_jax import init_params, make_batch, make_mesh
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.data import ArithmeticSource, DataError, make_dataset, make_source
from bdlm_jax.data.sources import held_out
from bdlm_jax.evaluate import arithmetic_prompts, make_eval_step, score_answers
from bdlm_jax.sample import checked_tokenizer


def _tiny(objective, **parallel):
  return replace(Config(), model=dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      head_dim=8, d_ff=64),
                 data=dict(seq_len=64), objective=dict(name=objective, block_size=8),
                 parallel=parallel, train=dict(batch_size=4),
                 eval=dict(noise_draws=2, prompts=0))


def _eval(cfg, params_key=0, tokens=None):
  mesh = make_mesh(cfg)
  params = init_params(cfg, jax.random.key(params_key), mesh)
  if tokens is None:
    tokens = np.random.default_rng(7).integers(0, 256, (cfg.train.batch_size, cfg.data.seq_len))
  total, count = make_eval_step(cfg, mesh)(params, make_batch(cfg, tokens), jax.random.key(3))
  return float(total) / int(count)


@pytest.mark.slow
@pytest.mark.parametrize("objective, parallel", [
    ("bd3lm", dict(strategy="csbp_ring", seq=4)),
    ("bd3lm", dict(strategy="cp_allgather", seq=2, data=2)),
    ("fast_dllm_v2", dict(strategy="bp", seq=4)),
    ("ar", dict(strategy="cp_ring", seq=4)),
])
def test_held_out_loss_is_the_same_under_every_strategy(objective, parallel):
  one = _eval(_tiny(objective))
  assert _eval(_tiny(objective, **parallel)) == pytest.approx(one, rel=1e-5)


def _uniform(params):
  """Zero embeddings (tied to the head): every hidden state and logit is 0."""
  return dict(params, embed=jax.tree.map(np.zeros_like, params["embed"]))


@pytest.mark.slow
def test_a_uniform_models_nll_is_log_vocab_and_its_nelbo_log_vocab_without_mask():
  """AR: exactly log V. BD3-LM: the NELBO's 1/t weights undo the masking rate, so its
  expectation is the per-token CE, log(V - 1) with [MASK] excluded (SUBS)."""
  # bd3lm: one draw of 1024 tokens has a ~7.6% standard error (the 1/t weights); 64 draws ~1%.
  for objective, expected, rel in (("ar", math.log(260), 1e-5),
                                   ("bd3lm", math.log(259), 0.04)):
    cfg = replace(_tiny(objective), train=dict(batch_size=16), eval=dict(noise_draws=64))
    mesh = make_mesh(cfg)
    params = _uniform(init_params(cfg, jax.random.key(0), mesh))
    tokens = np.random.default_rng(1).integers(0, 256, (16, cfg.data.seq_len))
    total, count = make_eval_step(cfg, mesh)(params, make_batch(cfg, tokens), jax.random.key(2))
    assert float(total) / int(count) == pytest.approx(expected, rel=rel), objective


def test_chance_scores_each_completion_against_the_other_prompts_answers():
  completions = ["12 ", "7", "x", "12+3"]
  answers = ["12", "8", "7", "12"]
  accuracy, chance = score_answers(completions, answers)
  assert accuracy == 0.5  # "12 " and "12+3" start with their own answers; "x" with none
  # other-prompt hits: "12 " vs answer 3, "7" vs answer 2, "12+3" vs answer 0: 3 of 12 pairs
  assert chance == 3 / 12


def test_the_embedded_held_out_split_is_other_documents_and_prompts_come_from_it():
  train_docs = {ArithmeticSource(0)[i] for i in range(200)}
  held = [ArithmeticSource(0, split="eval")[i] for i in range(200)]
  assert not train_docs & set(held)
  for (prompt, answer), doc in zip(arithmetic_prompts(Config(), 20), held):
    assert prompt.endswith("=") and (prompt + answer) in doc


def test_held_out_prompts_and_their_answers_fit_the_trained_length():
  """The quickstart's L = 64: a prompt keeps its document's latest whole statements that fit
  with its answer (no "more than data.seq_len" warning in its own evaluation)."""
  cfg = replace(Config(), data=dict(seq_len=64))
  pairs = arithmetic_prompts(cfg, 512)
  tokenizer = checked_tokenizer(cfg)
  fits = [len(tokenizer.encode(p)) + len(tokenizer.encode(a)) <= 64 for p, a in pairs]
  assert all(fits)
  whole = arithmetic_prompts(replace(cfg, data=dict(seq_len=4096)), 512)
  cut = [(p, q) for (p, _), (q, _) in zip(pairs, whole) if p != q]
  assert cut and all(q.endswith(" " + p) for p, q in cut)  # the latest whole statements


def _split(data_cfg, split):
  return list(held_out(grain.MapDataset.source(make_source(data_cfg, 0, split)), data_cfg, split))


def test_a_file_source_holds_out_its_last_documents_or_reads_eval_path(tmp_path):
  lines = [f"document number {i}" for i in range(20)]
  (tmp_path / "d.txt").write_text("\n".join(lines) + "\n")
  (tmp_path / "e.txt").write_text("held out elsewhere\n")
  cfg = replace(Config(), data=dict(source="text", path=str(tmp_path / "d.txt"), holdout=0.1))
  assert _split(cfg.data, "train") == lines[:18] and _split(cfg.data, "eval") == lines[18:]
  with_path = replace(cfg, data=dict(eval_path=str(tmp_path / "e.txt"))).data
  assert _split(with_path, "train") == lines and _split(with_path, "eval") == [
      "held out elsewhere"]
  with pytest.raises(DataError, match="holds out none of them.*data.eval_path"):
    make_dataset(replace(cfg, data=dict(holdout=0.01)).data, batch_size=1, seed=0,
                 vocab_size=260, split="eval")


@pytest.mark.slow
def test_training_logs_held_out_metrics_and_mode_eval_repeats_them_under_another_strategy(
    tmp_path, capsys):
  overrides = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
               "model.head_dim=16", "model.d_ff=64", "data.seq_len=32", "objective.block_size=8",
               "train.steps=4", "train.batch_size=4", "train.eval_every=2", "train.log_every=4",
               "train.ckpt_every=4", "eval.batches=2", "eval.noise_draws=2", "eval.prompts=6"]
  cfg_path = "configs/quickstart_bd3lm.py"
  workdir = str(tmp_path / "run")
  assert run.main(["--config", cfg_path, "--workdir", workdir, "--no-progress",
                   *(a for o in overrides for a in ("--set", o))]) == 0
  out = capsys.readouterr().out
  assert "held-out NELBO" in out and "sample: '" in out
  rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
  last = rows[-1]
  assert 0 <= last["eval_chance"] <= 1 and 0 <= last["eval_accuracy"] <= 1
  assert last["eval_ppl"] == pytest.approx(math.exp(last["eval_loss"]))

  for strategy in ("none", "csbp_ring"):
    assert run.main(["--config", cfg_path, "--workdir", workdir, "--set", "mode=eval",
                     "--set", f"parallel.strategy={strategy}",
                     "--set", f"parallel.seq={1 if strategy == 'none' else 2}",
                     *(a for o in overrides for a in ("--set", o))]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert got["step"] == 4
    assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5), strategy
    assert got["eval_accuracy"] == last["eval_accuracy"]


def test_mode_eval_on_a_missing_workdir_says_so_and_creates_nothing(tmp_path, capsys):
  workdir = tmp_path / "never_trained"
  assert run.main(["--config", "configs/quickstart_bd3lm.py", "--workdir", str(workdir),
                   "--set", "mode=eval"]) == 2
  assert f"{workdir} does not exist: no checkpoint to restore" in capsys.readouterr().err
  assert not workdir.exists()
