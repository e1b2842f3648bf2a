"""mode=prepare: a corpus tokenized once reads back as the very batches of the on-the-fly
pipeline; a killed prepare continues; a folder that does not fit the config says why."""

import dataclasses
import json
import os

import numpy as np
import pytest

import run
from bdlm_jax.config import Config, DataConfig, PrepareConfig
from bdlm_jax.data import DataError, make_dataset
from bdlm_jax.data import prepare as prep
from bdlm_jax.errors import ConfigError

L, BATCH, BLOCK, MASK = 64, 4, 8, 259
CONVERSATIONS = [
    [{"role": "user", "content": f"{i}+{i}="}, {"role": "assistant", "content": str(2 * i)}]
    for i in range(30)]


def text_corpus(tmp_path, n=60, name="corpus.txt"):
  """Short, empty, longer-than-L and non-ASCII lines."""
  lines = [f"doc {i} " + "xyz" * (i % 7) * 9 for i in range(n)]
  lines[3] = "a doc with \u00e9 accents"
  (tmp_path / name).write_text("\n\n".join(lines) + "\n")
  return str(tmp_path / name)


def chat_corpus(tmp_path, name="chat.jsonl"):
  (tmp_path / name).write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
  return str(tmp_path / name)


def config(data: DataConfig, out_dir, **prepare) -> Config:
  return Config(data=data, mode="prepare",
                prepare=PrepareConfig(out_dir=str(out_dir), **{"num_processes": 1, **prepare}))


def tokens_of(data: DataConfig, out_dir, **kw) -> DataConfig:
  return dataclasses.replace(data, source="tokens", path=str(out_dir), **kw)


def batches(data: DataConfig, n=6, vocab_size=260, mask=MASK, **kw):
  it = make_dataset(data, batch_size=BATCH, seed=3, vocab_size=vocab_size, block_size=BLOCK,
                    mask_token_id=mask, **kw)
  return [next(it) for _ in range(n)]


def assert_byte_identical(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      assert x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes(), k


@pytest.mark.parametrize("kind", ["text", "chat", "hf_text_spelling_out_mask"])
def test_prepared_tokens_give_byte_identical_batches_to_tokenizing_on_the_fly(
    tmp_path, kind, hf_tokenizer_path):
  model = {}
  if kind == "text":
    data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L)
  elif kind == "chat":
    data = DataConfig(source="jsonl", path=chat_corpus(tmp_path), format="chat", seq_len=L)
  else:  # [MASK] is in the stored ids and dropped as they are read, as when tokenizing
    (tmp_path / "c.txt").write_text("".join(f"the cat {'[MASK] ' * (i % 3)}sat far\n" * i
                                            for i in range(1, 9)))
    data = DataConfig(source="text", path=str(tmp_path / "c.txt"), tokenizer=hf_tokenizer_path,
                      seq_len=16)
    tok = prep.make_tokenizer(data)
    model = dict(vocab_size=tok.vocab_size, mask=tok.mask_id)
  prep.prepare(config(data, tmp_path / "ids", shard_tokens=200), progress=False)
  assert_byte_identical(batches(tokens_of(data, tmp_path / "ids"), **model),
                        batches(data, **model))


def test_several_processes_write_the_records_one_process_writes(tmp_path):
  data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L)
  one = prep.prepare(config(data, tmp_path / "one"), progress=False)[str(tmp_path / "one")]
  two = prep.prepare(config(data, tmp_path / "two", num_processes=2, shard_tokens=300),
                     progress=False)[str(tmp_path / "two")]
  assert len(two["shards"]) > 2 and (one["documents"], one["tokens"]) == (
      two["documents"], two["tokens"])
  read = [prep.TokenSource(str(tmp_path / d), data, prep.make_tokenizer(data))
          for d in ("one", "two")]
  assert all(np.array_equal(read[0][i], read[1][i]) for i in range(len(read[0])))


def test_the_held_out_split_is_the_same_from_prepared_tokens(tmp_path):
  data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L, holdout=0.2)
  prep.prepare(config(data, tmp_path / "ids"), progress=False)
  prepared = tokens_of(data, tmp_path / "ids")
  assert_byte_identical(batches(prepared, split="eval"), batches(data, split="eval"))
  # data.eval_path: held-out files are prepared into the folder's eval/ as well.
  data = dataclasses.replace(data, eval_path=text_corpus(tmp_path, n=9, name="held_out.txt"))
  folders = prep.prepare(config(data, tmp_path / "both"), progress=False)
  assert list(folders) == [str(tmp_path / "both"), str(tmp_path / "both" / "eval")]
  prepared = tokens_of(data, tmp_path / "both", eval_path=str(tmp_path / "both" / "eval"))
  for split in ("train", "eval"):
    assert_byte_identical(batches(prepared, split=split), batches(data, split=split))


def test_a_killed_prepare_continues_where_it_stopped(tmp_path, monkeypatch):
  data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L)
  cfg = config(data, tmp_path / "ids", shard_tokens=150)
  write_range, calls, killed = prep._write_range, [], []

  def killed_on_the_third_call(first, end, *args):
    calls.append((first, end))
    if len(calls) == 3 and not killed:
      killed.append((first, end))
      raise KeyboardInterrupt
    return write_range(first, end, *args)

  monkeypatch.setattr(prep, "_write_range", killed_on_the_third_call)
  with pytest.raises(KeyboardInterrupt):
    prep.prepare(cfg, progress=False)
  with pytest.raises(DataError, match="unfinished .* rerun its mode=prepare"):
    make_dataset(tokens_of(data, tmp_path / "ids"), batch_size=BATCH, seed=0, vocab_size=260)
  (tmp_path / "ids" / "shard-000000000040.array_record.tmp").write_bytes(b"cut short")
  done = calls[:2]
  calls.clear()
  prep.prepare(cfg, progress=False)
  assert calls[0][0] == done[-1][1]  # the finished ranges are not tokenized again
  assert sorted(os.listdir(tmp_path / "ids")) == sorted(
      ["meta.json"] + [s["file"] for s in prep._read_meta(str(tmp_path / "ids"))["shards"]])
  assert_byte_identical(batches(tokens_of(data, tmp_path / "ids")), batches(data))
  calls.clear()
  prep.prepare(cfg, progress=False)  # a finished folder: nothing to do
  assert not calls


def test_command_line_prepares_and_says_how_to_read_it(tmp_path, capsys):
  (tmp_path / "cfg.py").write_text(
      "from bdlm_jax.config import Config, DataConfig\n"
      f"def get_config():\n  return Config(data=DataConfig(source='text', "
      f"path={text_corpus(tmp_path)!r}, seq_len=64))\n")
  out_dir = tmp_path / "ids"
  args = ["--config", str(tmp_path / "cfg.py"), "--no-progress", "--set", "mode=prepare",
          "--set", f"prepare.out_dir={out_dir}", "--set", "prepare.num_processes=1"]
  assert run.main(args) == 0
  assert f"--set data.source=tokens --set data.path={out_dir}" in capsys.readouterr().out
  assert run.main(args + ["--set", "data.tokenizer=nope.json"]) == 2
  assert capsys.readouterr().err.startswith("error: data.tokenizer='nope.json'")


def test_missing_foreign_and_corrupt_folders_are_clear_errors(tmp_path, hf_tokenizer_path):
  data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L)
  read = lambda d: make_dataset(d, batch_size=BATCH, seed=0, vocab_size=260)
  with pytest.raises(ConfigError, match="is not a folder; write one with --set mode=prepare"):
    read(tokens_of(data, tmp_path / "nowhere"))
  with pytest.raises(ConfigError, match="holds no meta.json"):
    read(tokens_of(data, tmp_path))
  prep.prepare(config(data, tmp_path / "ids"), progress=False)
  with pytest.raises(ConfigError, match="does not fit the config: tokenizer_fingerprint "
                                        "'byte' .* tokenized with data.tokenizer='byte'"):
    make_dataset(tokens_of(data, tmp_path / "ids", tokenizer=hf_tokenizer_path),
                 batch_size=BATCH, seed=0, vocab_size=260)
  with pytest.raises(ConfigError, match="format 'text' .config data.format: 'chat'"):
    read(tokens_of(data, tmp_path / "ids", format="chat"))
  meta = tmp_path / "ids" / "meta.json"
  meta.write_text(meta.read_text()[:-40])
  with pytest.raises(DataError, match="meta.json is corrupt"):
    read(tokens_of(data, tmp_path / "ids"))


def test_prepare_refuses_what_it_cannot_or_should_not_write(tmp_path):
  data = DataConfig(source="text", path=text_corpus(tmp_path), seq_len=L)
  with pytest.raises(ConfigError, match="data.source='arithmetic' has nothing to tokenize"):
    prep.prepare(config(DataConfig(), tmp_path / "ids"), progress=False)
  with pytest.raises(ConfigError, match="needs prepare.out_dir"):
    prep.prepare(config(data, ""), progress=False)
  with pytest.raises(ConfigError, match="not empty and holds no preparation"):
    prep.prepare(config(data, tmp_path), progress=False)
  prep.prepare(config(data, tmp_path / "ids"), progress=False)
  other = dataclasses.replace(data, path=text_corpus(tmp_path, n=5, name="other.txt"))
  with pytest.raises(ConfigError, match="holds a preparation of another corpus"):
    prep.prepare(config(other, tmp_path / "ids"), progress=False)
