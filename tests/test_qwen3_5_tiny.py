"""configs/qwen3_5_tiny.py (docs/gdn.md, "Try it"): through run.py, on packed rows
(`data.pack=true`: several arithmetic documents a row, each restarting the Gated DeltaNet
state), step 1's loss under csbp_ring on 4 of the simulated devices equals the one-device loss
(1e-5 relative). The 27B recipe's own data (the embedded arithmetic packed at 262,144 tokens)
passes `make_batch`."""

import os

import pytest

import run
from tests.test_cli import step_1_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "qwen3_5_tiny.py")
# One step of 2 sequences: the compile is most of it.
# Seed 4's first batch packs two documents (and padding) in a row.
SETS = ["train.steps=1", "train.log_every=1", "train.batch_size=2", "train.ckpt_every=1",
        "data.pack=true", "seed=4"]


def _step1_loss(workdir, *sets) -> float:
  return step_1_loss(CONFIG, workdir, [*SETS, *sets])


@pytest.mark.slow
def test_qwen3_5_tiny_under_csbp_ring_gives_the_one_device_step_1_loss(tmp_path):
  one = _step1_loss(tmp_path / "none")
  csbp = _step1_loss(tmp_path / "csbp", "parallel.strategy=csbp_ring", "parallel.seq=4")
  assert csbp == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
def test_training_with_eval_and_mode_eval_sample_the_hybrid(tmp_path, capsys):
  """The end-of-training eval and mode=eval decode the Gated DeltaNet hybrid (its state and
  conv tail cached per block): a sample, an accuracy and tokens per forward."""
  _step1_loss(tmp_path, "train.eval_every=1", "eval.batches=1", "eval.prompts=4")
  assert "sample: '" in capsys.readouterr().out
  assert run.main(["--config", CONFIG, "--no-progress", "--workdir", str(tmp_path),
                   *[arg for item in [*SETS, "mode=eval", "eval.batches=1", "eval.prompts=4"]
                     for arg in ("--set", item)]]) == 0
  out = capsys.readouterr().out
  assert "step 1 of " in out and "arithmetic accuracy" in out and "tokens per forward" in out


@pytest.mark.parametrize("segment_ids", [False, True], ids=["one_stream", "per_document"])
def test_the_27b_recipes_packed_data_passes_make_batch(segment_ids):
  """One row of configs/qwen3_5_27b_fast_dllm_v2_256k.py's data (packed: thousands of
  documents in 262,144 tokens) laid out for its csbp_ring on 16 ranks: the seed's one stream
  (the config's), or each document its own segment."""
  from bdlm_jax.batch import make_batch
  from bdlm_jax.configure import load_config
  from bdlm_jax.data import make_dataset
  cfg = load_config(os.path.join(REPO, "configs", "qwen3_5_27b_fast_dllm_v2_256k.py"),
                    [f"data.segment_ids={str(segment_ids).lower()}"])
  row = next(make_dataset(cfg.data, batch_size=1, seed=cfg.seed,
                          vocab_size=cfg.model.vocab_size, block_size=cfg.objective.block_size,
                          mask_token_id=cfg.objective.mask_token_id))
  documents = row["segment_ids"].max()
  assert documents > 1000 if segment_ids else documents == 1
  batch = make_batch(cfg, row["tokens"], row["segment_ids"])
  assert batch.seg.shape == (1, 2 * cfg.data.seq_len)
