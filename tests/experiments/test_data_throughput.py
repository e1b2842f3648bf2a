"""The data-throughput benchmark runs end to end on a tiny corpus. Which path is faster is the
benchmark's finding (`python experiments/data_throughput.py`, docs/usage.md), not a test's:
a timing order over fractions of a second does not hold on cores shared with other jobs."""

from experiments import data_throughput as dt


def test_tiny_run_prints_a_row_per_tokenizer():
  rows = dt.measure(seq_len=1024, batch_size=2, corpus_mb=0.3, seconds=0.3, processes=1,
                   doc_words=(100, 2_000))
  assert [r["tokenizer"] for r in rows] == ["byte", "BPE 8K"]
  assert rows[0]["tokens"] > rows[1]["tokens"] > 0  # BPE merges bytes
  assert all(r["prepared"] > 0 and r["on_the_fly"] > 0 for r in rows)
  assert dt.table(rows, 1).count("\n") == 3


def test_tiny_run_times_every_file_source():
  rows = dt.measure_sources(seq_len=1024, batch_size=2, corpus_mb=0.2, seconds=0.2,
                            row_group=16, doc_words=(100, 2_000))
  assert [r["source"] for r in rows] == ["text", "jsonl", "parquet", "hf"]
  assert len({r["documents"] for r in rows}) == 1 and all(r["tokens_per_s"] > 0 for r in rows)
  assert dt.sources_table(rows).count("\n") == 5
