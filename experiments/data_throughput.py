"""Input pipeline tokens/s at L = 256K: tokenizing on the fly vs ids prepared once, and the
same documents read from JSONL, Parquet and a `datasets` folder.

  python experiments/data_throughput.py              # ~2 minutes on 2 CPU cores
  python experiments/data_throughput.py --quick      # smoke run, seconds
  # SFT-sized documents from each file source only, ~1 minute:
  python experiments/data_throughput.py --sources_only --seq_len 4096 --batch_size 8 \
      --corpus_mb 20 --seconds 10 --doc_words 50 1000 --row_group 64

Generates a corpus of long documents (Zipf-distributed words, 8K to 1.5M characters each),
trains a small byte-level BPE tokenizer on it (tokenizers, offline), prepares both tokenizers'
ids with mode=prepare, then times `make_dataset`'s packed batches of `--seq_len` tokens on
the on-the-fly path (data.source=text) and the prepared one (data.source=tokens), same seed.
Tokens/s counts real tokens (segment > 0) per second of `next(batches)` after one warm-up
batch. The second table reads the corpus's documents, byte-tokenized on the fly and
shuffled, from a text file, JSONL, Parquet (`--row_group` rows a row group) and a
`datasets` folder (save_to_disk). Prints Markdown tables.
"""

import argparse
import dataclasses
import json
import os
import tempfile
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from bdlm_jax.config import Config, DataConfig, PrepareConfig
from bdlm_jax.data import make_dataset
from bdlm_jax.data.prepare import prepare

EOS = "<|endoftext|>"


def write_corpus(path: str, megabytes: float, doc_words: tuple[int, int], seed: int = 0) -> None:
  """One document per line: words drawn Zipf-wise from a made-up 20K-word vocabulary, a
  log-uniform number of them in `doc_words` per document."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
  words = ["".join(rng.choice(letters, rng.integers(1, 11))) for _ in range(20_000)]
  p = 1.0 / np.arange(1, len(words) + 1)
  words, p = np.array(words), p / p.sum()
  written = 0
  with open(path, "w") as f:
    while written < megabytes * 1e6:
      n_words = int(np.exp(rng.uniform(*np.log(doc_words))))
      line = " ".join(words[rng.choice(len(words), n_words, p=p)]) + "\n"
      f.write(line)
      written += len(line)


def train_bpe(corpus: str, path: str, vocab_size: int) -> str:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  with open(corpus) as f:
    sample = [f.readline()[:200_000] for _ in range(8)]
  tok.train_from_iterator(sample, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(path)
  return path


def tokens_per_s(data: DataConfig, batch_size: int, vocab_size: int, seconds: float) -> float:
  it = make_dataset(data, batch_size=batch_size, seed=0, vocab_size=vocab_size)
  next(it)  # warm-up: threads started, read-ahead filled
  tokens, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    tokens += int(np.count_nonzero(next(it)["segment_ids"]))
  return tokens / (time.perf_counter() - start)


def measure(seq_len: int, batch_size: int, corpus_mb: float, seconds: float, processes: int,
            doc_words: tuple[int, int] = (1_500, 250_000)) -> list[dict]:
  """One row per tokenizer: the corpus's counts, prepare's time and both paths' tokens/s."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus.txt")
    write_corpus(corpus, corpus_mb, doc_words)
    bpe = train_bpe(corpus, os.path.join(tmp, "tokenizer.json"), 8192)
    for name, tokenizer, vocab_size in (("byte", "byte", 260), ("BPE 8K", bpe, 8192)):
      text = DataConfig(source="text", path=corpus, tokenizer=tokenizer, seq_len=seq_len)
      out_dir = os.path.join(tmp, f"ids_{vocab_size}")
      start = time.perf_counter()
      meta = prepare(Config(data=text, prepare=PrepareConfig(
          out_dir=out_dir, num_processes=processes)), progress=False)[out_dir]
      prepare_s = time.perf_counter() - start
      ids = dataclasses.replace(text, source="tokens", path=out_dir)
      rows.append(dict(tokenizer=name, documents=meta["documents"], tokens=meta["tokens"],
                       prepare_s=prepare_s,
                       on_the_fly=tokens_per_s(text, batch_size, vocab_size, seconds),
                       prepared=tokens_per_s(ids, batch_size, vocab_size, seconds)))
  return rows


def measure_sources(seq_len: int, batch_size: int, corpus_mb: float, seconds: float,
                    row_group: int, doc_words: tuple[int, int] = (1_500, 250_000)) -> list[dict]:
  """tokens/s of the byte-tokenized documents of one corpus from each file source."""
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus.txt")
    write_corpus(corpus, corpus_mb, doc_words)
    with open(corpus) as f:
      docs = f.read().splitlines()
    with open(os.path.join(tmp, "corpus.jsonl"), "w") as f:
      f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"text": docs}), os.path.join(tmp, "corpus.parquet"),
                   row_group_size=row_group)
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(os.path.join(tmp, "hf"))
    paths = dict(text="corpus.txt", jsonl="corpus.jsonl", parquet="corpus.parquet", hf="hf")
    return [dict(source=source, documents=len(docs), tokens_per_s=tokens_per_s(
                DataConfig(source=source, path=os.path.join(tmp, path), seq_len=seq_len),
                batch_size, 260, seconds))
            for source, path in paths.items()]


def sources_table(rows: list[dict]) -> str:
  lines = ["| data.source | documents | tokens/s | vs text |", "|---|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['source']} | {r['documents']:,} | {r['tokens_per_s'] / 1e6:.2f}M | "
                 f"{r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x |")
  return "\n".join(lines)


def table(rows: list[dict], processes: int) -> str:
  lines = [f"| tokenizer | documents | tokens | prepare (once, {processes} processes) | "
           f"on the fly | prepared | ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['tokenizer']} | {r['documents']:,} | {r['tokens'] / 1e6:.1f}M | "
        f"{r['prepare_s']:.1f} s ({r['tokens'] / r['prepare_s'] / 1e6:.2f}M tokens/s) | "
        f"{r['on_the_fly'] / 1e6:.2f}M tokens/s | {r['prepared'] / 1e6:.2f}M tokens/s | "
        f"{r['prepared'] / r['on_the_fly']:.1f}x |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_len", type=int, default=262_144)
  parser.add_argument("--batch_size", type=int, default=2)
  parser.add_argument("--corpus_mb", type=float, default=40)
  parser.add_argument("--seconds", type=float, default=20, help="timed per measurement")
  parser.add_argument("--processes", type=int, default=2, help="prepare.num_processes")
  parser.add_argument("--row_group", type=int, default=64, help="Parquet rows per row group")
  parser.add_argument("--doc_words", type=int, nargs=2, default=(1_500, 250_000),
                      help="words per document: the range drawn log-uniformly from")
  parser.add_argument("--sources_only", action="store_true", help="only the sources table")
  parser.add_argument("--quick", action="store_true", help="tiny corpus and documents, L = 4096")
  args = parser.parse_args()
  if args.quick:
    args.seq_len, args.corpus_mb, args.seconds = 4096, 1, 0.5
  doc_words = (100, 5_000) if args.quick else tuple(args.doc_words)
  print(f"L = {args.seq_len:,}, batch {args.batch_size}, {os.cpu_count()} CPU cores, "
        f"data.num_threads=2, corpus {args.corpus_mb:g} MB of {doc_words[0]:,}-"
        f"{doc_words[1]:,}-word documents\n")
  if not args.sources_only:
    print(table(measure(args.seq_len, args.batch_size, args.corpus_mb, args.seconds,
                        args.processes, doc_words=doc_words), args.processes) + "\n")
  print(f"byte tokenizer, shuffled, Parquet row groups of {args.row_group} rows:\n")
  print(sources_table(measure_sources(args.seq_len, args.batch_size, args.corpus_mb,
                                      args.seconds, args.row_group, doc_words)))


if __name__ == "__main__":
  main()
