"""Records and sources beside JSONL messages: prompt/completion and tokenized records score
what they say, Parquet shards and `datasets` folders read as the same records, and bad input
names its file and record."""

import dataclasses
import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bdlm_jax.config import Config, DataConfig, PrepareConfig
from bdlm_jax.data import ByteTokenizer, DataError, make_dataset
from bdlm_jax.data import prepare as prep
from bdlm_jax.data.sources import ParquetRecords
from bdlm_jax.errors import ConfigError

B, L = 4, 64
IDS = [72, 105, 33, 257]  # "Hi!" and EOS
RECORDS = [
    {"prompt": "Q: 2+2=", "completion": "4"},
    {"input_ids": [81, 58, 32] + IDS, "labels": [-100, -100, -100] + IDS},
    {"input_ids": [81, 58, 32] + IDS, "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
]
# What each record scores, and its prompt (the rest of its real tokens).
SCORED = {("Q: 2+2=", "4<eos>"), ("Q: ", "Hi!<eos>"), ("User: hi\nAssistant: ", "yo<eos>")}


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def write_parquet(folder, records, shards=2):
  """`records` as `shards` Parquet files in `folder`, one row group per 2 rows; the columns
  a record lacks are null."""
  folder.mkdir()
  columns = sorted({k for r in records for k in r})
  for i in range(shards):
    part = records[i::shards]
    table = pa.table({c: [r.get(c) for r in part] for c in columns})
    pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=2)
  return str(folder)


def write_datasets(folder, records):
  columns = sorted({k for r in records for k in r})
  datasets.Dataset.from_dict({c: [r.get(c) for r in records] for c in columns}).save_to_disk(
      str(folder))
  return str(folder)


def examples(data: DataConfig, n_batches=2):
  """{(prompt, scored text)} of the examples of the first batches."""
  tok, found = ByteTokenizer(), set()
  data_iter = make_dataset(data, batch_size=2, seed=0, vocab_size=260, block_size=B)
  for _ in range(n_batches):
    batch = next(data_iter)
    for tokens, seg, protected in zip(batch["tokens"], batch["segment_ids"], batch["protected"]):
      for s in np.unique(seg[seg > 0]):
        found.add((tok.decode(tokens[(seg == s) & protected]),
                   tok.decode(tokens[(seg == s) & ~protected], skip_special=False)))
  return found


def chat(source, path, **kw):
  return DataConfig(source=source, path=path, format="chat", seq_len=L, shuffle=False,
                    holdout=0.0, **kw)


def test_prompt_completion_and_tokenized_records_score_what_they_say(tmp_path):
  assert examples(chat("jsonl", write_jsonl(tmp_path / "r.jsonl", RECORDS))) == SCORED


def test_parquet_shards_and_a_datasets_folder_give_the_jsonl_examples(tmp_path):
  """One table of every record type: the columns a row does not use are null."""
  parquet = write_parquet(tmp_path / "pq", RECORDS)
  assert len(ParquetRecords(parquet)) == 4
  hf = write_datasets(tmp_path / "hf", RECORDS)
  for data in (chat("parquet", parquet), chat("parquet", f"{parquet}/part-*.parquet"),
               chat("hf", hf)):
    assert examples(data) == SCORED


def test_text_documents_from_a_parquet_column_and_a_datasets_folder(tmp_path):
  docs = [f"doc {i}" for i in range(6)]
  folder = tmp_path / "pq"
  folder.mkdir()
  pq.write_table(pa.table({"body": docs}), folder / "a.parquet", row_group_size=4)
  datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "hf"))
  tok = ByteTokenizer()
  for source, path in (("parquet", str(folder)), ("hf", str(tmp_path / "hf"))):
    data = DataConfig(source=source, path=path, text_field="body", seq_len=16, shuffle=False,
                      pack=False, holdout=0.0)
    batch = next(make_dataset(data, batch_size=6, seed=0, vocab_size=260))
    assert [tok.decode(row) for row in batch["tokens"]] == docs
    with pytest.raises(DataError, match=f"no text field 'text' .* at .*row 0; record has "
                                        f"\\['body'\\]"):
      make_dataset(dataclasses.replace(data, text_field="text"), batch_size=2, seed=0,
                   vocab_size=260)


@pytest.mark.parametrize("record, error", [
    ({"input_ids": [1, 2, 3], "labels": [-100, 2]},
     "'labels' at {where} has 2 entries and 'input_ids' 3"),
    ({"input_ids": [1, 2, 3], "labels": [-100, 5, 3]},
     "'labels' at {where} must be -100 or the input id .* position 1 has label 5"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, "'loss_mask' at {where} must hold 0 or 1"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, "record at {where} scores no token"),
    ({"input_ids": [1, 999], "loss_mask": [0, 1]},
     "{where}: input id 999 lies outside the vocabulary of data.tokenizer \\(size 260\\)"),
    ({"input_ids": [1, 2]}, "record at {where} needs 'input_ids' and one of 'labels'"),
    ({"prompt": "a"}, "record at {where} needs a string 'prompt' and a non-empty string"),
    ({"text": "a"}, "record at {where} has no 'messages', 'prompt' and 'completion'"),
    ({"messages": [{"role": "user", "content": "a"}]}, "{where} has no assistant response")])
def test_a_bad_record_is_named_by_file_and_line(tmp_path, record, error):
  path = write_jsonl(tmp_path / "r.jsonl", [RECORDS[0], record])
  data = make_dataset(chat("jsonl", path), batch_size=2, seed=0, vocab_size=260, block_size=B)
  with pytest.raises(DataError, match=error.format(where=f"{path}:2")):
    next(data)


def test_bad_sources_say_what_is_wrong(tmp_path):
  with pytest.raises(ConfigError, match="is a folder with no \\*.parquet file"):
    ParquetRecords(str(tmp_path))
  (tmp_path / "bad.parquet").write_text("not parquet")
  with pytest.raises(DataError, match="cannot read Parquet file .*bad.parquet"):
    ParquetRecords(str(tmp_path / "bad.parquet"))
  with pytest.raises(DataError, match="data.source=hf.* cannot be read"):
    make_dataset(chat("hf", str(tmp_path)), batch_size=2, seed=0, vocab_size=260)


def test_prepare_reads_parquet_records_into_the_same_examples(tmp_path):
  """Id 0 scored and not: a stored record keeps what it scores whatever the id."""
  zeros = [{"input_ids": [0, 0, 65], "loss_mask": [0, 1, 1]}]
  data = chat("parquet", write_parquet(tmp_path / "pq", RECORDS + zeros))
  prep.prepare(Config(data=data, mode="prepare",
                      prepare=PrepareConfig(out_dir=str(tmp_path / "ids"), num_processes=1)),
               progress=False)
  on_the_fly = examples(data, n_batches=3)
  assert on_the_fly == SCORED | {("\x00", "\x00A")}
  assert examples(dataclasses.replace(data, source="tokens", path=str(tmp_path / "ids")),
                  n_batches=3) == on_the_fly
  with pytest.raises(ConfigError, match="supervise None .*data.supervise: 'assistant'|"
                                        "supervise 'assistant' .*data.supervise: 'last'"):
    make_dataset(dataclasses.replace(data, source="tokens", path=str(tmp_path / "ids"),
                                     supervise="last"), batch_size=2, seed=0, vocab_size=260)
