"""Grain random-access sources of text documents (`len` + `getitem` -> str).

File sources take `data.path` as one file or a glob (files read in sorted order), local or a
URL that etils.epath reads (`gs://bucket/shard-*.jsonl`):
* text: one document per non-empty line (a corpus with one document per line is the common
  case, and lines give cheap random access; put multi-line documents in JSONL instead);
* jsonl: one JSON object per non-empty line, the document under `data.text_field`;
* array_record: each record a UTF-8 JSON object (read by `data.text_field`) or raw UTF-8 text;
* parquet: a file, glob or folder of `*.parquet` shards, the document in column `text_field`;
* hf: a Hugging Face `datasets` folder (`save_to_disk`) or hub name, the same column.
Files are indexed once (line offsets, row groups) and read lazily, so large corpora stay out
of memory. jsonl, parquet and hf rows are records (`make_records`), which data.format=chat
reads as chat records (data/chat.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import glob
import json
import os

import grain
import numpy as np
from etils import epath

from bdlm_jax.config import DATA_SOURCES, RECORD_SOURCES, DataConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.data.arithmetic import ArithmeticSource


class DataError(ValueError):
  """A data file that exists but cannot be used; the message names the file (and line)."""


def _expand(path: str) -> list[epath.Path]:
  root, pattern = os.path.expanduser(path), ""
  while glob.has_magic(root):  # root: the folders before the first wildcard
    head, slash, name = root.rpartition("/")
    root, pattern = head or slash, f"{name}/{pattern}" if pattern else name
  root = epath.Path(root)
  files = sorted(root.glob(pattern)) if pattern else [root] if root.exists() else []
  if not files:
    raise ConfigError(f"data.path={path!r} matches no file")
  for f in files:
    if not f.is_file():
      raise ConfigError(f"data.path={path!r}: {f} is not a file")
  return files


class TextLineSource:
  """One document per non-empty line of UTF-8 text files."""

  def __init__(self, path: str):
    self._files = _expand(path)
    rows = []  # (file, byte offset, byte length, 1-based line number) per document
    for file_id, file in enumerate(self._files):
      try:
        with file.open("rb") as f:
          offset = 0
          for lineno, line in enumerate(f, 1):
            if line.strip():
              rows.append((file_id, offset, len(line), lineno))
            offset += len(line)
      except OSError as e:
        raise DataError(f"cannot read data file {file}: {e}") from e
    if not rows:
      raise DataError(f"data.path={path!r}: no non-empty lines in {self._files}")
    self._rows_Nx4 = np.asarray(rows, dtype=np.int64)

  def __len__(self) -> int:
    return len(self._rows_Nx4)

  def where(self, index: int) -> str:
    """The "file:line" of document `index`, for error messages."""
    file_id, _, _, lineno = self._rows_Nx4[index]
    return f"{self._files[file_id]}:{lineno}"

  def __getitem__(self, index: int) -> str:
    file_id, offset, length, _ = self._rows_Nx4[index]
    try:
      with self._files[file_id].open("rb") as f:
        f.seek(offset)
        raw = f.read(length)
      return raw.decode("utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
      raise DataError(f"cannot read document at {self.where(index)}: {e}") from e


class JsonlRecords(TextLineSource):
  """One JSON value per non-empty line: a record."""

  def firsts(self) -> list[int]:
    """Each file's first record: read at start-up, so that a wrong format fails then."""
    return np.unique(self._rows_Nx4[:, 0], return_index=True)[1].tolist()

  def __getitem__(self, index: int):
    line = super().__getitem__(index)
    try:
      return json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"invalid JSON at {self.where(index)}: {e}") from e


class ParquetRecords:
  """The rows of Parquet files (a file, a glob, or a folder of `*.parquet` shards) as dicts
  of their columns. A row is read from its row group, of which the last few read are kept
  decoded (as Arrow tables): sequential reading decodes each once, shuffled reading one per
  row, so shards written with small row groups (`row_group_size`) shuffle faster."""

  _CACHED_GROUPS = 4

  def __init__(self, path: str):
    import pyarrow.parquet as pq
    self._path = path
    root = epath.Path(os.path.expanduser(path))
    self._files = sorted(root.glob("*.parquet")) if root.is_dir() else _expand(path)
    if not self._files:
      raise ConfigError(f"data.path={path!r} is a folder with no *.parquet file")
    self._groups = []  # (file, row group, first row) of every row group, in order
    try:
      for file_id, file in enumerate(self._files):
        with file.open("rb") as f:
          meta = pq.ParquetFile(f).metadata
          self.columns = meta.schema.to_arrow_schema().names
          for g in range(meta.num_row_groups):
            self._groups.append((file_id, g, meta.row_group(g).num_rows))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
      raise DataError(f"cannot read Parquet file {file}: {e}") from e
    self._ends = np.cumsum([n for _, _, n in self._groups]).tolist()
    if not self._ends or not self._ends[-1]:
      raise DataError(f"data.path={path!r}: no rows in {self._files}")
    self._read_group = functools.lru_cache(self._CACHED_GROUPS)(self._decode_group)

  def __len__(self) -> int:
    return self._ends[-1]

  def __getstate__(self) -> dict:  # spawned workers (mode=prepare) build their own cache
    return {k: v for k, v in self.__dict__.items() if k != "_read_group"}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._read_group = functools.lru_cache(self._CACHED_GROUPS)(self._decode_group)

  def _locate(self, index: int) -> tuple[int, int]:
    group = bisect.bisect_right(self._ends, index)
    return group, index - (self._ends[group - 1] if group else 0)

  def where(self, index: int) -> str:
    group, row = self._locate(index)
    file_id, g, _ = self._groups[group]
    rows_before = sum(n for f, h, n in self._groups if f == file_id and h < g)
    return f"{self._files[file_id]} row {rows_before + row}"

  def firsts(self) -> list[int]:
    starts = [0] + self._ends[:-1]
    return [starts[i] for i, (_, g, n) in enumerate(self._groups) if g == 0 and n]

  def _decode_group(self, group: int):
    """Row group `group` as an Arrow table."""
    import pyarrow.parquet as pq
    file_id, g, _ = self._groups[group]
    try:
      with self._files[file_id].open("rb") as f:
        return pq.ParquetFile(f).read_row_group(g)
    except (OSError, ValueError) as e:
      raise DataError(f"cannot read row group {g} of Parquet file {self._files[file_id]}: "
                      f"{e}") from e

  def __getitem__(self, index: int) -> dict:
    group, row = self._locate(index)
    return self._read_group(group).slice(row, 1).to_pylist()[0]


class HFRecords:
  """The rows of a Hugging Face `datasets` dataset as dicts: a folder that `save_to_disk`
  wrote (memory-mapped Arrow: random access without a copy in memory; a DatasetDict's
  `data.hf_split`), or a hub name, downloaded into the `datasets` cache at `data.hf_split`
  and `data.hf_revision`."""

  def __init__(self, path: str, split: str, revision: str):
    import datasets
    folder = os.path.expanduser(path)
    try:
      if os.path.isdir(folder):
        self._rows = datasets.load_from_disk(folder)
        if isinstance(self._rows, datasets.DatasetDict):
          if split not in self._rows:
            raise ConfigError(f"data.path={path!r} holds the splits {list(self._rows)}, not "
                              f"data.hf_split={split!r}")
          self._rows = self._rows[split]
      else:
        self._rows = datasets.load_dataset(path, split=split, revision=revision or None)
    except (FileNotFoundError, ValueError) as e:
      raise DataError(f"data.path={path!r} (data.source=hf) cannot be read as a datasets "
                      f"folder (save_to_disk) or hub dataset: {e}") from e
    self._path, self.columns = path, self._rows.column_names
    if not len(self._rows):
      raise DataError(f"data.path={path!r} (data.source=hf): no rows")

  def __len__(self) -> int:
    return len(self._rows)

  def where(self, index: int) -> str:
    return f"{self._path} row {index}"

  def firsts(self) -> list[int]:
    return [0]

  def __getitem__(self, index: int) -> dict:
    return self._rows[int(index)]


class FieldSource:
  """Text documents: the `text_field` string of each record."""

  def __init__(self, records, text_field: str):
    self._records, self._field = records, text_field
    for first in records.firsts():  # a wrong field name fails at start-up, not hours in
      self[first]

  def __len__(self) -> int:
    return len(self._records)

  def where(self, index: int) -> str:
    return self._records.where(index)

  def __getitem__(self, index: int) -> str:
    return _text_field(self._records[index], self._field, self.where(index))


class JsonlSource(FieldSource):
  """One JSON object per non-empty line; the document is its `text_field` string."""

  def __init__(self, path: str, text_field: str):
    super().__init__(JsonlRecords(path), text_field)


class ArrayRecordSource:
  """ArrayRecord files; a record is a JSON object (read by `text_field`) or raw UTF-8 text."""

  def __init__(self, path: str, text_field: str):
    self._files = _expand(path)
    self._field = text_field
    self._sources = []
    for file in self._files:
      try:
        self._sources.append(grain.sources.ArrayRecordDataSource([str(file)]))
      except Exception as e:  # array_record raises bare RuntimeError/ValueError
        raise DataError(f"cannot read ArrayRecord file {file}: {e}") from e
    self._ends = np.cumsum([len(s) for s in self._sources]).tolist()
    if not self._ends[-1]:
      raise DataError(f"data.path={path!r}: no records in {self._files}")

  def __len__(self) -> int:
    return self._ends[-1]

  def _locate(self, index: int) -> tuple[int, int]:
    """(file, record in it) of record `index`."""
    file_id = bisect.bisect_right(self._ends, index)
    return file_id, index - (self._ends[file_id - 1] if file_id else 0)

  def where(self, index: int) -> str:
    """The "file record n" of record `index`, for error messages."""
    file_id, position = self._locate(index)
    return f"{self._files[file_id]} record {position}"

  def __getitem__(self, index: int) -> str:
    file_id, position = self._locate(index)
    where = self.where(index)
    try:
      text = self._sources[file_id][position].decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"record is not UTF-8 at {where}: {e}") from e
    try:
      record = json.loads(text)
    except json.JSONDecodeError:
      return text  # raw text record
    return _text_field(record, self._field, where) if isinstance(record, dict) else text


def _text_field(record, field: str, where: str) -> str:
  if not isinstance(record, dict) or field not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"no text field {field!r} (data.text_field) at {where}; record has {keys}")
  if not isinstance(record[field], str):
    raise DataError(f"field {field!r} at {where} is {type(record[field]).__name__}, not a string")
  return record[field]


def make_records(data_cfg: DataConfig, split: str = "train"):
  """The records (dicts) of a jsonl, parquet or hf source's `split`."""
  path = split_path(data_cfg, split)
  if data_cfg.source == "jsonl":
    return JsonlRecords(path)
  if data_cfg.source == "parquet":
    return ParquetRecords(path)
  if data_cfg.source == "hf":
    return HFRecords(path, data_cfg.hf_split, data_cfg.hf_revision)
  raise ConfigError(f"data.source={data_cfg.source!r} has no records: one of jsonl, parquet, hf")


def make_source(data_cfg: DataConfig, seed: int, split: str = "train"):
  """The random-access source named by `data.source`, before any hold-out (`held_out`)."""
  if data_cfg.source == "arithmetic":
    return ArithmeticSource(seed, split=split)
  data_cfg = dataclasses.replace(data_cfg, path=split_path(data_cfg, split), eval_path="")
  if not data_cfg.path:
    raise ConfigError(f"data.source={data_cfg.source!r} needs data.path")
  if data_cfg.source == "text":
    return TextLineSource(data_cfg.path)
  if data_cfg.source == "array_record":
    return ArrayRecordSource(data_cfg.path, data_cfg.text_field)
  if data_cfg.source in RECORD_SOURCES:
    return FieldSource(make_records(data_cfg), data_cfg.text_field)
  raise ConfigError(f"data.source={data_cfg.source!r} is not one of {list(DATA_SOURCES)}")


def split_path(data_cfg: DataConfig, split: str) -> str:
  """The files of `split`: `data.eval_path` for "eval" where set, else `data.path`."""
  return data_cfg.eval_path if split == "eval" and data_cfg.eval_path else data_cfg.path


def held_out(docs: grain.MapDataset, data_cfg: DataConfig, split: str) -> grain.MapDataset:
  """The documents of `split` of a file source: the last `data.holdout` fraction is held out
  unless `data.eval_path` names separate held-out files (then training keeps every one)."""
  if data_cfg.source == "arithmetic" or data_cfg.eval_path:
    return docs  # the split was chosen by make_source
  n_held = int(len(docs) * data_cfg.holdout)
  if split == "train":
    return docs[:len(docs) - n_held]
  if not n_held:
    raise DataError(
        f"data.path={data_cfg.path!r} has {len(docs)} documents; data.holdout="
        f"{data_cfg.holdout} holds out none of them for evaluation: raise data.holdout or set "
        f"data.eval_path to held-out files")
  return docs[len(docs) - n_held:]
