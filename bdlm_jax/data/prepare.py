"""Tokenize once (mode=prepare): a corpus's documents as token ids in ArrayRecord shards,
which `data.source=tokens` reads back into the same packed pipeline. A long-document corpus
is otherwise tokenized again every epoch, on the training host's few cores.

A prepared folder holds
* `shard-<first>-<end>.array_record`: documents [first, end) of the source, in its order, one
  record each, int32 little-endian: a text document's ids and EOS; a chat example's ids, a
  scored one stored as its bitwise complement (negative: ids are >= 0);
* `meta.json`: what was tokenized (source, path, format, tokenizer and its fingerprint), the
  counts (documents, tokens) and the shards, each with the sha256 of its file and a digest of
  its records, written last: a folder without it is unfinished. `fingerprint` (of the
  records, whatever the sharding) is what a checkpoint records of the data it trained on.
While it runs, `progress.jsonl` logs each shard as soon as it is written (atomically: a
temporary file, then a rename); a rerun of a killed prepare keeps every logged shard whose
sha256 matches and tokenizes the rest. A run that opens the folder checks every shard's
sha256 (reading the folder once) and names a damaged or missing one; rerunning the same
mode=prepare checks the shards too and rewrites only the damaged ones. The ids are the
tokenizer's own: the objective's [MASK] is dropped, and conversations are padded to whole
blocks and cut to L, as they are read, so one folder serves every objective, block size and
`data.seq_len`.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import re
import signal
import threading
import time
import warnings

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from bdlm_jax.checksums import sha256
from bdlm_jax.config import Config, DataConfig
from bdlm_jax.data import chat
from bdlm_jax.data.sources import DataError, make_source
from bdlm_jax.data.tokenizers import Tokenizer, make_tokenizer
from bdlm_jax.errors import ConfigError

META, PROGRESS = "meta.json", "progress.jsonl"
VERSION = 1
# One record per chunk: reading a document decompresses that document only.
_WRITER_OPTIONS = "group_size:1,zstd:1"
_SHARD = re.compile(r"shard-(\d+)-(\d+)\.array_record")
_UNITS_PER_PROCESS = 8  # pieces of work per process: finer progress and a fairer split
_DIGEST_MOD = 1 << 128  # record digests add up modulo this: independent of the sharding


def tokenize(tokenizer: Tokenizer, doc: str | dict):
  """A document's ids as packing needs them: int32 [T] ending in EOS for text; for a chat
  example (chat.example) {"tokens": int32 [T], "scored": bool [T]}: its spans encoded one by
  one (chat.EOS: the EOS id), or its ids checked against the vocabulary. mode=prepare stores
  these."""
  if isinstance(doc, str):
    return np.asarray(tokenizer.encode(doc) + [tokenizer.eos_id], np.int32)
  if "spans" in doc:
    pieces = [[tokenizer.eos_id] if text is chat.EOS else tokenizer.encode(text)
              for text, _ in doc["spans"]]
    return {"tokens": np.asarray([i for piece in pieces for i in piece], np.int32),
            "scored": np.repeat([scored for _, scored in doc["spans"]], list(map(len, pieces)))}
  tokens = doc["tokens"]
  outside = (tokens < 0) | (tokens >= tokenizer.vocab_size)
  if outside.any():
    raise DataError(f"input id {tokens[outside][0]} lies outside the vocabulary of "
                    f"data.tokenizer (size {tokenizer.vocab_size})")
  return {"tokens": tokens.astype(np.int32), "scored": doc["scored"]}


def _record(ids) -> bytes:
  if isinstance(ids, dict):
    ids = np.where(ids["scored"], ~ids["tokens"], ids["tokens"])
  return np.asarray(ids, "<i4").tobytes()


def _identity(data_cfg: DataConfig, tokenizer: Tokenizer, documents: int) -> dict:
  """What a folder was prepared from; a rerun must match it to continue."""
  is_chat = data_cfg.format == "chat"
  return dict(version=VERSION, source=data_cfg.source, path=data_cfg.path,
              text_field=data_cfg.text_field, format=data_cfg.format,
              chat_template=data_cfg.chat_template if is_chat else "",
              **(dict(supervise=data_cfg.supervise, messages_field=data_cfg.messages_field)
                 if is_chat else {}),
              tokenizer=data_cfg.tokenizer, tokenizer_fingerprint=tokenizer.fingerprint,
              vocab_size=tokenizer.vocab_size, documents=documents)


# Writing.

def check_config(cfg: Config) -> None:
  """mode=prepare needs a file corpus and somewhere to put its ids."""
  if cfg.data.source in ("arithmetic", "tokens"):
    raise ConfigError(f"mode=prepare tokenizes a text, jsonl, array_record, parquet or hf "
                      f"corpus; "
                      f"data.source={cfg.data.source!r} has nothing to tokenize")
  if cfg.data.mixture:
    raise ConfigError(f"mode=prepare tokenizes one corpus (data.path), not data.mixture="
                      f"{cfg.data.mixture!r}: prepare each entry into its own folder")
  if not cfg.prepare.out_dir:
    raise ConfigError("mode=prepare needs prepare.out_dir, the folder to write the ids to")
  if "://" in cfg.prepare.out_dir:
    raise ConfigError(f"prepare.out_dir={cfg.prepare.out_dir!r} must be a local folder "
                      f"(copy it to a bucket afterwards)")


def prepare(cfg: Config, progress: bool = True) -> dict[str, dict]:
  """Tokenizes `data.path` into `prepare.out_dir` (and `data.eval_path`, if set, into its
  `eval/` folder); returns {folder: its metadata}. A rerun continues an unfinished folder."""
  check_config(cfg)
  folders = {os.path.expanduser(cfg.prepare.out_dir): cfg.data.path}
  if cfg.data.eval_path:
    folders[os.path.join(os.path.expanduser(cfg.prepare.out_dir), "eval")] = cfg.data.eval_path
  return {folder: _prepare_split(cfg, path, folder, progress) for folder, path in folders.items()}


def _prepare_split(cfg: Config, path: str, out_dir: str, progress: bool) -> dict:
  data_cfg = dataclasses.replace(cfg.data, path=path, eval_path="")
  tokenizer = make_tokenizer(data_cfg)
  if tokenizer.eos_id is None:
    raise ConfigError(f"data.tokenizer={data_cfg.tokenizer!r} has no end-of-document token; "
                      f"packing needs one to end each document")
  source = (chat.make_chat_source(data_cfg, cfg.seed, "train") if data_cfg.format == "chat"
            else make_source(data_cfg, cfg.seed))
  identity = _identity(data_cfg, tokenizer, len(source))
  done = _start(out_dir, identity)
  if done is None:
    return _read_meta(out_dir)  # already prepared
  todo = _gaps(done, len(source))
  n_processes = cfg.prepare.num_processes or os.cpu_count() or 1
  units = _units(todo, n_processes * _UNITS_PER_PROCESS)
  bar = tqdm(total=len(source), initial=sum(s["end"] - s["first"] for s in done), unit="doc",
             desc=f"tokenizing into {out_dir}", disable=not progress)
  with bar:
    def finished(shards: list[dict]) -> None:  # _write_range logged them
      done.extend(shards)
      bar.update(sum(s["end"] - s["first"] for s in shards))
      bar.set_postfix(tokens=f"{sum(s['tokens'] for s in done):,}")

    args = (out_dir, cfg.prepare.shard_tokens)
    if n_processes == 1 or len(units) <= 1:
      _start_worker(source, tokenizer)
      for first, end in units:
        finished(_write_range(first, end, *args))
    else:
      with _worker_pool(min(n_processes, len(units)), source, tokenizer, out_dir) as pool:
        for shards in pool.imap_unordered(_write_unit, [(*unit, *args) for unit in units]):
          finished(shards)
  return _finish(out_dir, identity, done)


@contextlib.contextmanager
def _worker_pool(n: int, source, tokenizer, out_dir: str):
  """`n` spawned tokenizing processes (JAX's threads make fork unsafe), terminated on the way
  out, a bad document or Ctrl-C included: what they finished is logged. They ignore SIGINT
  (a Ctrl-C reaches the whole process group; the parent stops them, and one still starting
  up would print a traceback): the parent ignores it while it starts them, a setting they
  keep through exec. That takes milliseconds, as the source and tokenizer go through a file
  (the arguments of a spawned process are written to a pipe the parent waits on, until the
  child has started and read them). They exit if the parent dies (else a kill -9 leaves
  them blocked on their queue, with the resource tracker)."""
  state = os.path.join(out_dir, "workers.pickle.tmp")  # removed by a rerun, as other .tmp
  with open(state, "wb") as f:
    pickle.dump((source, tokenizer), f)
  main = threading.current_thread() is threading.main_thread()
  handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
  try:
    pool = multiprocessing.get_context("spawn").Pool(
        n, initializer=_start_pool_worker, initargs=(state, os.getpid()))
  finally:
    if main:
      signal.signal(signal.SIGINT, handler)
  try:
    yield pool
  finally:
    pool.terminate()
    pool.join()
    os.remove(state)


def _start(out_dir: str, identity: dict) -> list[dict] | None:
  """The shards a previous run of this preparation finished (None: all of them, checked)."""
  where = f"prepare.out_dir={out_dir!r}"
  meta_file, log_file = os.path.join(out_dir, META), os.path.join(out_dir, PROGRESS)
  if os.path.exists(meta_file):
    meta = _read_meta(out_dir)
    _check_same(meta, identity, where)
    damaged = _damaged(out_dir, meta["shards"])
    if not damaged:
      return None
    warnings.warn(f"{where}: rewriting {_describe(damaged)}")
    good = [s for s in meta["shards"] if s["file"] not in damaged]
    tmp = log_file + ".tmp"  # unfinished again: the log of the good shards, then no meta.json
    with open(tmp, "w") as f:
      f.write("".join(json.dumps(s) + "\n" for s in [identity, *good]))
    os.replace(tmp, log_file)
    os.remove(meta_file)
    for name in damaged:
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, name))
    return good
  os.makedirs(out_dir, exist_ok=True)
  if not os.path.exists(log_file):
    if os.listdir(out_dir):
      raise ConfigError(f"{where} is not empty and holds no preparation; choose a new folder")
    with open(log_file, "w") as f:
      f.write(json.dumps(identity) + "\n")
    return []
  with open(log_file) as f:
    lines = f.read().splitlines()
  try:
    logged = json.loads(lines[0])
  except (IndexError, json.JSONDecodeError) as e:
    raise DataError(f"{log_file} is corrupt ({e}); delete {out_dir} and prepare again") from e
  _check_same(logged, identity, where)
  done = []
  for line in lines[1:]:
    try:
      shard = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by the kill: that shard is written again
    if os.path.exists(os.path.join(out_dir, shard["file"])):
      done.append(shard)
  damaged = _damaged(out_dir, done)  # renamed, but not on disk whole when the host died
  done = [s for s in done if s["file"] not in damaged]
  for name in os.listdir(out_dir):
    if name.endswith(".tmp"):
      os.remove(os.path.join(out_dir, name))  # a shard the kill cut short
  return done


def _check_same(found: dict, identity: dict, where: str) -> None:
  wrong = [f"{k} {found.get(k)!r} (now {v!r})" for k, v in identity.items()
           if found.get(k) != v]
  if wrong:
    raise ConfigError(f"{where} holds a preparation of another corpus or tokenizer: "
                      f"{'; '.join(wrong)}; choose another prepare.out_dir, or delete it")


def _gaps(done: list[dict], n: int) -> list[tuple[int, int]]:
  """The document ranges in [0, n) that no finished shard covers."""
  gaps, at = [], 0
  for s in sorted(done, key=lambda s: s["first"]):
    if s["first"] > at:
      gaps.append((at, s["first"]))
    at = max(at, s["end"])
  return gaps + ([(at, n)] if at < n else [])


def _units(gaps: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
  """`gaps` cut into about `count` ranges of documents, the work of one call each."""
  size = max(1, math.ceil(sum(end - first for first, end in gaps) / count))
  return [(i, min(i + size, end)) for first, end in gaps for i in range(first, end, size)]


_WORKER = {}  # this process's source and tokenizer, set once by _start_worker


def _start_worker(source, tokenizer) -> None:
  _WORKER.update(source=source, tokenizer=tokenizer)


def _start_pool_worker(state: str, parent: int) -> None:
  threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
  with open(state, "rb") as f:
    _start_worker(*pickle.load(f))


def _exit_with(parent: int) -> None:
  """Ends this worker once `parent` is gone (it is then adopted by another process)."""
  while os.getppid() == parent:
    time.sleep(0.5)
  os._exit(1)


def _write_unit(args: tuple) -> list[dict]:
  return _write_range(*args)


def _write_range(first: int, end: int, out_dir: str, shard_tokens: int) -> list[dict]:
  """Tokenizes documents [first, end) into shards that close past `shard_tokens` tokens,
  logging each to progress.jsonl as it is written."""
  source, tokenizer = _WORKER["source"], _WORKER["tokenizer"]
  shards, start, tokens, digest, writer, tmp = [], first, 0, 0, None, None
  for i in range(first, end):
    if writer is None:
      tmp = os.path.join(out_dir, f"shard-{i:012d}.array_record.tmp")
      writer = ArrayRecordWriter(tmp, _WRITER_OPTIONS)
    doc = source[i]
    try:
      ids = tokenize(tokenizer, doc)
    except DataError as e:  # text the tokenizer cannot encode: say which document
      raise DataError(f"{source.where(i)}: {e}") from e
    record = _record(ids)
    writer.write(record)
    digest = (digest + _record_digest(i, record)) % _DIGEST_MOD
    tokens += len(ids["tokens"]) if isinstance(ids, dict) else len(ids)
    if tokens >= shard_tokens or i + 1 == end:
      writer.close()
      name = f"shard-{start:012d}-{i + 1:012d}.array_record"
      shard = dict(file=name, first=start, end=i + 1, tokens=tokens, sha256=sha256(tmp),
                   records=f"{digest:032x}")
      os.replace(tmp, os.path.join(out_dir, name))
      with open(os.path.join(out_dir, PROGRESS), "a") as log:  # one short append per shard
        log.write(json.dumps(shard) + "\n")
        log.flush()
        os.fsync(log.fileno())
      shards.append(shard)
      start, tokens, digest, writer = i + 1, 0, 0, None
  return shards


def _record_digest(index: int, record: bytes) -> int:
  """Document `index`'s record as a number; the sum over documents is the folder's content,
  in order, however it is cut into shards."""
  h = hashlib.blake2b(record, digest_size=16, key=index.to_bytes(8, "little"))
  return int.from_bytes(h.digest(), "little")


def _damaged(folder: str, shards: list[dict]) -> dict[str, str]:
  """{file: what is wrong} for each shard that is missing or whose sha256 differs from the
  one it was written with (shards of older folders have none, and are not checked)."""
  damaged = {}
  for s in shards:
    path = os.path.join(folder, s["file"])
    if not os.path.exists(path):
      damaged[s["file"]] = "missing"
    elif "sha256" in s and sha256(path) != s["sha256"]:
      damaged[s["file"]] = "damaged: its sha256 differs from the one it was written with"
  return damaged


def _describe(damaged: dict[str, str]) -> str:
  return "; ".join(f"shard {name} ({why})" for name, why in damaged.items())


def fingerprint(meta: dict) -> str | None:
  """The records of a prepared folder (`meta`), in order, whatever the sharding: equal
  fingerprints, equal data. None for a folder prepared before shards had digests."""
  if not all("records" in s for s in meta["shards"]):
    return None
  return f"{sum(int(s['records'], 16) for s in meta['shards']) % _DIGEST_MOD:032x}"


def folder_fingerprint(folder: str) -> str | None:
  """`fingerprint` of the prepared folder's meta.json (read, not verified)."""
  return fingerprint(_read_meta(os.path.expanduser(folder)))


def _finish(out_dir: str, identity: dict, done: list[dict]) -> dict:
  shards = sorted(done, key=lambda s: s["first"])
  meta = dict(identity, tokens=sum(s["tokens"] for s in shards), shards=shards)
  meta["fingerprint"] = fingerprint(meta)
  tmp = os.path.join(out_dir, META + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1)
  os.replace(tmp, os.path.join(out_dir, META))
  _read_meta(out_dir)  # the shards tile the documents
  kept = {s["file"] for s in shards}
  for name in os.listdir(out_dir):
    if _SHARD.fullmatch(name) and name not in kept:
      os.remove(os.path.join(out_dir, name))  # written again after a kill, under another name
  os.remove(os.path.join(out_dir, PROGRESS))
  return meta


# Reading.

def _read_meta(folder: str) -> dict:
  """The folder's meta.json, checked to describe shards that tile its documents."""
  where = f"data.path={folder!r} (data.source=tokens)"
  if not os.path.isdir(folder):
    raise ConfigError(f"{where} is not a folder; write one with --set mode=prepare "
                      f"--set prepare.out_dir={folder}")
  file = os.path.join(folder, META)
  if not os.path.exists(file):
    if os.path.exists(os.path.join(folder, PROGRESS)):
      raise DataError(f"{where} is unfinished (no {META}): rerun its mode=prepare to finish it")
    raise ConfigError(f"{where} holds no {META}: it is not a folder that mode=prepare wrote")
  try:
    with open(file) as f:
      meta = json.load(f)
    at = 0
    for s in meta["shards"]:
      if (s["first"], type(s["file"]), type(s["tokens"])) != (at, str, int) or s["end"] <= at:
        raise ValueError(f"shard {s} does not continue from document {at}")
      at = s["end"]
    if at != meta["documents"] or meta["version"] != VERSION:
      raise ValueError(f"shards end at document {at} of {meta['documents']}, version "
                       f"{meta['version']} (this code reads {VERSION})")
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DataError(f"{file} is corrupt ({type(e).__name__}: {e}); prepare the folder "
                    f"again") from e
  return meta


class TokenSource:
  """A prepared folder's documents in source order, as `tokenize` gave them."""

  def __init__(self, folder: str, data_cfg: DataConfig, tokenizer: Tokenizer):
    folder = os.path.expanduser(folder)
    self.meta = meta = _read_meta(folder)
    want = dict(tokenizer_fingerprint=("data.tokenizer", tokenizer.fingerprint),
                vocab_size=("data.tokenizer's vocab size", tokenizer.vocab_size),
                format=("data.format", data_cfg.format))
    if data_cfg.format == "chat":
      want.update(chat_template=("data.chat_template", data_cfg.chat_template),
                  supervise=("data.supervise", data_cfg.supervise))
    wrong = [f"{k} {meta.get(k)!r} (config {key}: {value!r})"
             for k, (key, value) in want.items() if meta.get(k) != value]
    if wrong:
      raise ConfigError(
          f"data.path={folder!r} (data.source=tokens) does not fit the config: "
          f"{'; '.join(wrong)}; set these as the folder has them (it was tokenized with "
          f"data.tokenizer={meta.get('tokenizer')!r}), or prepare it again with this config")
    self._chat = meta["format"] == "chat"
    self._folder, self._firsts = folder, [s["first"] for s in meta["shards"]]
    damaged = _damaged(folder, meta["shards"])
    if damaged:
      raise DataError(f"data.path={folder!r} (data.source=tokens): {_describe(damaged)}. "
                      f"{self._rebuild()}")
    if not all("sha256" in s for s in meta["shards"]):
      warnings.warn(f"data.path={folder!r} was prepared before shards had checksums: its "
                    f"records are not checked; prepare it again to have them checked")
    files = [os.path.join(folder, s["file"]) for s in meta["shards"]]
    try:
      self._records = grain.sources.ArrayRecordDataSource(files)
      count = len(self._records)
    except Exception as e:  # array_record raises bare RuntimeError/ValueError
      raise DataError(f"cannot read the shards of data.path={folder!r}: {e}") from e
    if count != meta["documents"]:
      raise DataError(f"data.path={folder!r} has {count} records, but its {META} counts "
                      f"{meta['documents']} documents; prepare the folder again")

  def __len__(self) -> int:
    return self.meta["documents"]

  def _rebuild(self) -> str:
    m = self.meta
    return (f"Rebuild it: rerun the mode=prepare that wrote it (data.path={m['path']!r}, "
            f"data.tokenizer={m['tokenizer']!r}, prepare.out_dir={self._folder!r}); it checks "
            f"every shard and rewrites only the damaged ones")

  def __getitem__(self, index: int):
    try:
      record = self._records[index]
    except RuntimeError as e:  # array_record's "Corrupted Riegeli/records file" and the like
      shard = self.meta["shards"][bisect.bisect_right(self._firsts, index) - 1]["file"]
      raise DataError(f"data.path={self._folder!r}: document {index} in shard {shard} cannot "
                      f"be read ({e}). {self._rebuild()}") from e
    ids = np.frombuffer(record, "<i4").astype(np.int32, copy=False)
    if self._chat:
      return {"tokens": np.where(ids < 0, ~ids, ids), "scored": ids < 0}
    return ids
