"""data.mixture: weighted sources drawn in their proportions, each on its own shuffled
epochs, resumed exactly from the iterator's state; bad entries are named."""

import json

import numpy as np
import pytest

from bdlm_jax.config import DataConfig
from bdlm_jax.configure import replace
from bdlm_jax.config import Config
from bdlm_jax.data import ByteTokenizer, DataError, make_dataset
from bdlm_jax.errors import ConfigError


def corpus(tmp_path, name, n):
  """`n` JSONL documents "<name> <i>"."""
  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(n)))
  return str(path)


def mixture(tmp_path, weights="0.8,0.2", sizes=(50, 7)):
  a, b = corpus(tmp_path, "a", sizes[0]), corpus(tmp_path, "b", sizes[1])
  wa, wb = weights.split(",")
  return DataConfig(source="jsonl", mixture=f"{a}:{wa},{b}:{wb}", seq_len=8, pack=False,
                    holdout=0.0)


def documents(data_iter, n_batches):
  """The document of each row of the next batches ("a 3", ...), in order."""
  tok = ByteTokenizer()
  return [tok.decode(row[seg > 0]) for _ in range(n_batches)
          for row, seg in zip(*(lambda b: (b["tokens"], b["segment_ids"]))(next(data_iter)))]


def test_a_two_source_mixture_holds_its_proportions_and_each_source_its_epochs(tmp_path,
                                                                                capsys):
  data = make_dataset(mixture(tmp_path), batch_size=10, seed=0, vocab_size=260)
  assert capsys.readouterr().err.splitlines()[1:] == [
      f"  {tmp_path}/a.jsonl: 50 documents, weight 0.8",
      f"  {tmp_path}/b.jsonl: 7 documents, weight 0.2"]
  docs = documents(data, 40)  # 400 documents
  from_a = [d for d in docs if d.startswith("a ")]
  assert len(from_a) / len(docs) == pytest.approx(0.8, abs=0.02)
  # Each source reads a whole shuffled epoch before it repeats: a epochs of 50 documents.
  for epoch in range(len(from_a) // 50):
    assert sorted(from_a[50 * epoch:50 * (epoch + 1)]) == sorted(f"a {i}" for i in range(50))
  assert from_a[:50] != sorted(from_a[:50], key=lambda d: int(d.split()[1]))  # shuffled
  assert from_a[:50] != from_a[50:100]  # reshuffled every epoch


def test_a_mixture_resumes_exactly_from_the_iterator_state(tmp_path):
  cfg = mixture(tmp_path, "3,1")
  straight = make_dataset(cfg, batch_size=4, seed=1, vocab_size=260)
  documents(straight, 5)
  state = straight.get_state()
  expected = documents(straight, 10)
  resumed = make_dataset(cfg, batch_size=4, seed=1, vocab_size=260)
  resumed.set_state(json.loads(json.dumps(state)))
  assert documents(resumed, 10) == expected


@pytest.mark.parametrize("entries, error", [
    ("{a}:0.8,{b}:0", "data.mixture entry 2 '.*b.jsonl:0' must be PATH:WEIGHT with a weight > 0"),
    ("{a}:0.8,{b}:-1", "entry 2 .* weight > 0"),
    ("{a}", "entry 1 .* must be PATH:WEIGHT"),
    ("{a}:1,{b}:x", "entry 2 .* must be PATH:WEIGHT")])
def test_a_bad_mixture_entry_is_named(tmp_path, entries, error):
  a, b = corpus(tmp_path, "a", 3), corpus(tmp_path, "b", 3)
  with pytest.raises(ConfigError, match=error):
    replace(Config(), data=dict(source="jsonl", mixture=entries.format(a=a, b=b)))


def test_a_missing_or_bad_mixture_source_is_named(tmp_path):
  a = corpus(tmp_path, "a", 3)
  missing = DataConfig(source="jsonl", mixture=f"{a}:1,{tmp_path}/nope.jsonl:1", holdout=0.0)
  with pytest.raises(ConfigError, match=f"data.mixture entry 2 \\('{tmp_path}/nope.jsonl'\\): "
                                        f"data.path=.* matches no file"):
    make_dataset(missing, batch_size=2, seed=0, vocab_size=260)
  (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
  bad = DataConfig(source="jsonl", mixture=f"{a}:1,{tmp_path}/bad.jsonl:1", holdout=0.0)
  with pytest.raises(DataError, match="data.mixture entry 2 .*: no text field 'text'.*bad.jsonl:1"):
    make_dataset(bad, batch_size=2, seed=0, vocab_size=260)
  with pytest.raises(ConfigError, match="in place of data.path"):
    replace(Config(), data=dict(source="jsonl", path=a, mixture=f"{a}:1"))
