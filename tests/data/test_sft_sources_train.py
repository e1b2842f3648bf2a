"""The quickstart's model trains a few steps on the new kinds of SFT data (files built on the
spot), and a run on a mixture resumes onto the same batches as an uninterrupted one."""

import pytest

from bdlm_jax import feed, loop
from bdlm_jax.configure import replace
from tests.data.test_chat import MULTI_TURN
from tests.data.test_records import RECORDS, write_datasets, write_jsonl, write_parquet
from tests.test_train import Preempted, StopAfter, losses, tiny_config


def _cfg(steps=2, **data):
  """configs/quickstart_bd3lm.py's model, shrunk (tests/test_train.py), on chat records."""
  return replace(tiny_config(steps=steps, batch_size=4, ckpt_every=2, log_every=1),
                 data=dict(dict(format="chat", seq_len=32, holdout=0.0), **data))


def _sources(tmp_path):
  """Every record type in a Parquet folder and a datasets folder, and a JSONL mixture of
  multi-turn conversations and tokenized records."""
  write_jsonl(tmp_path / "chats.jsonl", [{"messages": MULTI_TURN[1:5]}] * 4)
  write_jsonl(tmp_path / "tokenized.jsonl", RECORDS[1:3] * 2)
  return dict(parquet=dict(source="parquet", path=write_parquet(tmp_path / "pq", RECORDS)),
              hf=dict(source="hf", path=write_datasets(tmp_path / "hf", RECORDS)),
              mixture=dict(source="jsonl", mixture=f"{tmp_path}/chats.jsonl:0.8,"
                                                   f"{tmp_path}/tokenized.jsonl:0.2"))


@pytest.mark.slow  # fast siblings: tests/data/test_records.py, test_mixture.py
@pytest.mark.parametrize("kind", ["parquet", "hf", "mixture"])
def test_the_quickstart_model_trains_on_parquet_datasets_and_a_mixture(tmp_path, kind):
  rows = loop.train(_cfg(**_sources(tmp_path)[kind]), str(tmp_path / "run"), progress=False)
  assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)


@pytest.mark.slow
def test_a_mixture_run_resumes_onto_the_batches_of_an_uninterrupted_one(tmp_path, monkeypatch):
  data = _sources(tmp_path)["mixture"]
  straight = losses(loop.train(_cfg(steps=6, **data), str(tmp_path / "straight"),
                               progress=False))
  make_dataset = feed.make_dataset
  monkeypatch.setattr(feed, "make_dataset",
                      lambda *a, **kw: StopAfter(make_dataset(*a, **kw), 3))
  with pytest.raises(Preempted):  # killed in step 4: the last checkpoint is step 2
    loop.train(_cfg(steps=6, **data), str(tmp_path / "resumed"), progress=False)
  monkeypatch.setattr(feed, "make_dataset", make_dataset)
  resumed = losses(loop.train(_cfg(steps=6, **data), str(tmp_path / "resumed"), resume=True,
                              progress=False))
  assert min(resumed) == 3
  for step, loss in resumed.items():
    assert loss == pytest.approx(straight[step], rel=1e-6), step
