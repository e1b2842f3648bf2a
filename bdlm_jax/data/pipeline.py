"""The training input pipeline: source -> tokenize -> shard -> shuffle -> pack -> batch.
(`data.source=tokens` reads documents that mode=prepare tokenized once: no tokenize step.)

One call gives this process's infinite, checkpointable iterator of packed batches:
`it.get_state()` is a JSON-serialisable dict and `it.set_state(state)` resumes exactly.
Everything is a pure function of the seed, so two runs with one seed see the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import grain

from bdlm_jax.config import DataConfig, mixture_entries
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import chat
from bdlm_jax.data.packing import one_per_row, one_stream, pack
from bdlm_jax.data.prepare import TokenSource, tokenize
from bdlm_jax.data.sources import DataError, held_out, make_source, split_path
from bdlm_jax.data.tokenizers import EOS_NAMES, Tokenizer, check_mask_id, make_tokenizer

# Documents read ahead. Grain's default (500) costs O(buffer) per element in grain 0.2.18
# (its prefetch-depth probe) and ~3x slower batches here; a few dozen keeps 2 threads busy.
_PREFETCH = 32


def _without_token(token_id: int, ids):
  """`ids` (an array, or a conversation's dict of them) without `token_id`: a document that
  spells out the [MASK] token literally (a tokenizer matches special tokens in raw text)
  loses that token, instead of stopping training at `make_batch`, which refuses [MASK]."""
  if isinstance(ids, dict):
    return {k: v[ids["tokens"] != token_id] for k, v in ids.items()}
  return ids[ids != token_id]


def _tokenize_at(tokenizer: Tokenizer, source, index: int, doc):
  """`tokenize`, whose DataError (text the tokenizer cannot encode) names the document's
  place in `source`: its file and line, or record."""
  try:
    return tokenize(tokenizer, doc)
  except DataError as e:
    raise DataError(f"{source.where(index)}: {e}") from e


def check_tokenizer(tokenizer: Tokenizer, data_cfg: DataConfig, vocab_size: int,
                    mask_token_id: int | None = None) -> None:
  """The tokenizer fits the model: its ids index the embedding, it has an EOS, and
  `mask_token_id` (None: a model without [MASK]) is no token of its data."""
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(
        f"data.tokenizer={data_cfg.tokenizer!r} has vocab size {tokenizer.vocab_size} but "
        f"model.vocab_size={vocab_size}: its ids would fall outside the embedding table; set "
        f"model.vocab_size >= {tokenizer.vocab_size}")
  if tokenizer.eos_id is None:
    raise ConfigError(
        f"data.tokenizer={data_cfg.tokenizer!r} has no end-of-document token "
        f"(looked for {list(EOS_NAMES)}); packing needs one to end each document")
  if mask_token_id is not None:
    check_mask_id(tokenizer, data_cfg, vocab_size, mask_token_id)


def _documents(data_cfg: DataConfig, tokenizer: Tokenizer, *, seed: int, split: str,
               process_index: int, process_count: int) -> tuple[grain.MapDataset, int]:
  """(this process's documents of `split` of one source, token ids, shuffled from `seed` on
  each epoch and repeated forever; the split's document count)."""
  is_chat, is_tokens = data_cfg.format == "chat", data_cfg.source == "tokens"
  if is_tokens:  # tokenized once by mode=prepare: its documents are ids already
    source = TokenSource(split_path(data_cfg, split), data_cfg, tokenizer)
  elif is_chat:
    source = chat.make_chat_source(data_cfg, seed, split)
  else:
    source = make_source(data_cfg, seed, split)
  docs = grain.MapDataset.source(source)
  if not is_tokens:  # before any slicing, while an index still says where a document is
    docs = docs.map_with_index(functools.partial(_tokenize_at, tokenizer, source))
  split_docs = held_out(docs, data_cfg, split)
  docs = split_docs[process_index::process_count]
  if not len(docs):
    where = (f"the held-out split of data.path={data_cfg.path!r} (data.eval_path="
             f"{data_cfg.eval_path!r}, data.holdout={data_cfg.holdout})" if split == "eval"
             else f"data.path={data_cfg.path!r}")
    raise DataError(f"{where} has {len(split_docs)} documents, too few to give each of "
                    f"{process_count} processes one")
  if data_cfg.shuffle:
    docs = docs.shuffle(seed)
  return docs.repeat(), len(split_docs)  # reshuffled every epoch


def make_dataset(data_cfg: DataConfig, *, batch_size: int, seed: int, vocab_size: int,
                 process_index: int = 0, process_count: int = 1,
                 block_size: int = 1, mask_token_id: int | None = None,
                 split: str = "train") -> grain.DatasetIterator:
  """This process's batches {"tokens", "segment_ids"}: int32 [batch_size, L], forever.

  With `data.format="chat"` batches also hold "protected" bool [batch_size, L] (what is not
  scored: prompts) and what was cut of examples longer than L ("prompt_cut", "response_cut"
  int32 [batch_size, L]), and every prompt and response is padded to whole blocks of
  `block_size` (see data/chat.py).

  Process p reads documents p, p + P, p + 2P, ... of the source (disjoint shards); each
  epoch is reshuffled from `seed` when `data.shuffle`. With `data.mixture`, each source is
  read so (source i shuffled from seed + i, on its own epochs), and Grain's `mix` interleaves
  them in the proportions of their weights (rounded to small integers: exact over each
  cycle); the sources, their sizes and weights are printed to stderr. Padding is `tokenizer.pad_id` with
  segment 0 (with `data.segment_ids=false`, every other token of a row is segment 1: one
  stream). `mask_token_id`, the objective's [MASK] (None for `ar`), is checked against the
  tokenizer before anything is read, and dropped from documents that spell it out. `split`
  ("train" or "eval") picks the training documents or the held-out ones (sources.held_out).
  """
  if not 0 <= process_index < process_count:
    raise ConfigError(f"process_index={process_index} must lie in [0, {process_count})")
  if batch_size < 1:
    raise ConfigError(f"batch_size={batch_size} must be >= 1")
  tokenizer = make_tokenizer(data_cfg)
  check_tokenizer(tokenizer, data_cfg, vocab_size, mask_token_id)
  shard = dict(seed=seed, split=split, process_index=process_index, process_count=process_count)
  if not data_cfg.mixture:
    docs = _documents(data_cfg, tokenizer, **shard)[0]
  else:
    parts, lines = [], []
    for i, (path, weight) in enumerate(mixture_entries(data_cfg.mixture)):
      part_cfg = dataclasses.replace(data_cfg, path=path, mixture="")
      try:
        part, size = _documents(part_cfg, tokenizer, **dict(shard, seed=seed + i))
      except (ConfigError, DataError) as e:
        raise type(e)(f"data.mixture entry {i + 1} ({path!r}): {e}") from e
      parts.append((part, weight))
      lines.append(f"  {path}: {size:,} documents, weight {weight:.4g}")
    if process_index == 0:
      print(f"data.mixture, {split} split:", *lines, sep="\n", file=sys.stderr)
    docs = grain.MapDataset.mix(*zip(*parts))
  if mask_token_id is not None:
    docs = docs.map(functools.partial(_without_token, mask_token_id))
  is_chat = data_cfg.format == "chat"
  if is_chat:
    docs = docs.map(functools.partial(chat.align, tokenizer.pad_id, block_size, data_cfg.seq_len))
  docs = docs.to_iter_dataset(grain.ReadOptions(
      num_threads=data_cfg.num_threads, prefetch_buffer_size=_PREFETCH))
  if is_chat:
    to_rows = chat.pack_chat if data_cfg.pack else chat.chat_per_row
  else:
    to_rows = pack if data_cfg.pack else one_per_row
  rows = to_rows(
      docs, seq_len=data_cfg.seq_len, pad_id=tokenizer.pad_id, num_bins=batch_size)
  if not data_cfg.segment_ids:  # the seed's continuous stream: a row is one document
    rows = rows.map(one_stream)
  return iter(rows.batch(batch_size, drop_remainder=True))
