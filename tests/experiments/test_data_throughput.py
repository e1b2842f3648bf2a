"""The data-throughput benchmark runs end to end on a tiny corpus, and the prepared path
beats tokenizing a BPE corpus on the fly."""

from experiments import data_throughput as dt


def test_tiny_run_prints_a_row_per_tokenizer_and_prepared_ids_read_faster():
  rows = dt.measure(seq_len=1024, batch_size=2, corpus_mb=0.3, seconds=0.3, processes=1,
                   doc_words=(100, 2_000))
  assert [r["tokenizer"] for r in rows] == ["byte", "BPE 8K"]
  assert rows[0]["tokens"] > rows[1]["tokens"] > 0  # BPE merges bytes
  assert rows[1]["prepared"] > rows[1]["on_the_fly"]
  assert dt.table(rows, 1).count("\n") == 3
