import json
import os

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from bdlm_jax.config import DataConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ArithmeticSource, DataError, make_source
from bdlm_jax.data.sources import ArrayRecordSource, JsonlSource, TextLineSource


def write_array_record(path, records):
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r.encode("utf-8"))
  writer.close()


def test_text_source_has_one_document_per_non_empty_line(tmp_path):
  (tmp_path / "a.txt").write_text("first doc\n\n  \nsecond doc\r\n")
  (tmp_path / "b.txt").write_text("third doc")  # no final newline
  src = TextLineSource(str(tmp_path / "*.txt"))
  assert [src[i] for i in range(len(src))] == ["first doc", "second doc", "third doc"]
  assert src.where(1).endswith("a.txt:4")


def test_a_gs_url_is_read_through_epath(fake_gcs):
  (fake_gcs / "corpus").mkdir()
  (fake_gcs / "corpus" / "shard-0.txt").write_text("first doc\nsecond doc\n")
  (fake_gcs / "corpus" / "shard-1.txt").write_text("third doc\n")
  src = TextLineSource("gs://corpus/shard-*.txt")
  assert [src[i] for i in range(len(src))] == ["first doc", "second doc", "third doc"]
  assert src.where(2) == "gs://corpus/shard-1.txt:1"


def test_jsonl_source_reads_the_text_field(tmp_path):
  rows = [{"text": "hello", "id": 1}, {"text": "two\nlines", "id": 2}]
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
  src = JsonlSource(str(tmp_path / "d.jsonl"), "text")
  assert [src[i] for i in range(len(src))] == ["hello", "two\nlines"]


def test_array_record_source_reads_json_and_raw_records(tmp_path):
  write_array_record(tmp_path / "a.array_record", [json.dumps({"body": "json doc"}), "raw doc"])
  write_array_record(tmp_path / "b.array_record", ["third"])
  src = ArrayRecordSource(str(tmp_path / "*.array_record"), "body")
  assert [src[i] for i in range(len(src))] == ["json doc", "raw doc", "third"]


def test_make_source_follows_the_config(tmp_path):
  (tmp_path / "d.txt").write_text("x\n")
  assert isinstance(make_source(DataConfig(), seed=0), ArithmeticSource)
  assert isinstance(make_source(DataConfig(source="text", path=str(tmp_path / "d.txt")), 0),
                    TextLineSource)


@pytest.mark.parametrize("source", ["text", "jsonl", "array_record"])
def test_missing_file_is_a_config_error_naming_the_path(tmp_path, source):
  path = str(tmp_path / "missing.*")
  with pytest.raises(ConfigError, match="matches no file"):
    make_source(DataConfig(source=source, path=path), seed=0)


def test_directory_path_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="is not a file"):
    TextLineSource(str(tmp_path))


def test_unreadable_file_is_a_data_error_naming_the_file(shared_tmp, permissions_enforced):
  path = shared_tmp / "secret.txt"
  with permissions_enforced():
    path.write_text("x\n")
    os.chmod(path, 0)
    with pytest.raises(DataError, match="secret.txt"):
      TextLineSource(str(path))


def test_bad_array_record_file_is_a_data_error_naming_the_file(tmp_path):
  (tmp_path / "bad.array_record").write_text("not an array record")
  with pytest.raises(DataError, match="bad.array_record"):
    ArrayRecordSource(str(tmp_path / "bad.array_record"), "text")


def test_wrong_jsonl_field_fails_at_start_up(tmp_path):
  (tmp_path / "d.jsonl").write_text(json.dumps({"content": "hi"}) + "\n")
  with pytest.raises(DataError, match=r"no text field 'text'.*d\.jsonl:1.*\['content'\]"):
    JsonlSource(str(tmp_path / "d.jsonl"), "text")


def test_jsonl_line_without_the_field_names_file_and_line(tmp_path):
  lines = [json.dumps({"text": "ok"}), "", json.dumps({"other": "bad"}), "{broken"]
  (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
  src = JsonlSource(str(tmp_path / "d.jsonl"), "text")
  with pytest.raises(DataError, match=r"d\.jsonl:3"):
    src[1]
  with pytest.raises(DataError, match=r"invalid JSON at .*d\.jsonl:4"):
    src[2]


def test_array_record_json_without_the_field_names_file_and_record(tmp_path):
  write_array_record(tmp_path / "a.array_record", [json.dumps({"text": "ok"}),
                                                   json.dumps({"other": "x"})])
  src = ArrayRecordSource(str(tmp_path / "a.array_record"), "text")
  with pytest.raises(DataError, match=r"a\.array_record record 1"):
    src[1]


def test_non_utf8_line_is_a_data_error_naming_file_and_line(tmp_path):
  (tmp_path / "d.txt").write_bytes(b"fine\n\xff\xfe broken\n")
  src = TextLineSource(str(tmp_path / "d.txt"))
  assert src[0] == "fine"
  with pytest.raises(DataError, match=r"d\.txt:2"):
    src[1]
