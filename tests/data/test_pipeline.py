import dataclasses
import json

import numpy as np
import pytest

from bdlm_jax.config import DataConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ByteTokenizer, DataError, HFTokenizer, make_dataset
from tests.data.conftest import save_word_level

L, BATCH = 64, 4
BYTES = ByteTokenizer()


def take(it, n):
  return [next(it) for _ in range(n)]


def batches_equal(a, b):
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def pieces(batch):
  """Every segment of every row: whole documents, or pieces of long ones."""
  return [tokens[seg == s] for tokens, seg in zip(batch["tokens"], batch["segment_ids"])
          for s in range(1, seg.max() + 1)]


def text_cfg(tmp_path, **kw):
  """A small corpus with short, empty and longer-than-L lines."""
  lines = [f"doc {i} " + "xyz" * (i % 5) * 8 for i in range(40)]
  (tmp_path / "corpus.txt").write_text("\n\n".join(lines) + "\n")
  return DataConfig(source="text", path=str(tmp_path / "corpus.txt"), seq_len=L, **kw)


def dataset(cfg, seed=0, **kw):
  return make_dataset(cfg, batch_size=BATCH, seed=seed, vocab_size=260, **kw)


def test_batches_are_int32_with_the_local_batch_shape():
  batch = next(dataset(DataConfig(seq_len=L)))
  assert batch.keys() == {"tokens", "segment_ids"}
  for k in batch:
    assert batch[k].shape == (BATCH, L) and batch[k].dtype == np.int32
  assert batch["tokens"].max() < 260


def test_same_seed_same_batches_other_seed_other_batches():
  cfg = DataConfig(seq_len=L)
  assert batches_equal(take(dataset(cfg, seed=1), 3), take(dataset(cfg, seed=1), 3))
  assert not batches_equal(take(dataset(cfg, seed=1), 3), take(dataset(cfg, seed=2), 3))


@pytest.mark.parametrize("source", ["arithmetic", "text"])
def test_iterator_state_round_trip_resumes_exactly(tmp_path, source):
  cfg = text_cfg(tmp_path) if source == "text" else DataConfig(seq_len=L)
  it = dataset(cfg)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON checkpoint
  expected = take(it, 12)  # crosses epochs of the 40-line corpus
  resumed = dataset(cfg)
  resumed.set_state(state)
  assert batches_equal(take(resumed, 12), expected)


def test_packed_rows_keep_documents_apart(tmp_path):
  eos, pad = BYTES.eos_id, BYTES.pad_id
  for batch in take(dataset(text_cfg(tmp_path)), 10):
    for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
      n_used = np.count_nonzero(seg)
      assert np.all(seg[:n_used] > 0) and np.all(seg[n_used:] == 0)  # padding only at the end
      assert np.all(tokens[n_used:] == pad)
      starts = np.flatnonzero(np.diff(seg[:n_used], prepend=0))
      assert np.array_equal(seg[starts], np.arange(1, len(starts) + 1))  # 1, 2, 3, contiguous
      for s in range(1, len(starts) + 1):
        piece = tokens[seg == s]
        assert not np.any(piece[:-1] == eos)  # EOS only ends a segment...
        assert piece[-1] == eos or len(piece) == L  # ...and ends it, unless cut from a long doc


@pytest.mark.parametrize("source", ["arithmetic", "text"])
def test_without_segment_ids_a_packed_row_is_one_stream(tmp_path, source):
  """data.segment_ids=false (the seed's continuous stream): the same rows, their documents one
  segment (1) up to the row's end padding (0)."""
  cfg = text_cfg(tmp_path) if source == "text" else DataConfig(seq_len=L)
  apart = take(dataset(cfg), 3)
  stream = take(dataset(dataclasses.replace(cfg, segment_ids=False)), 3)
  for a, b in zip(apart, stream):
    np.testing.assert_array_equal(b["tokens"], a["tokens"])
    np.testing.assert_array_equal(b["segment_ids"], (a["segment_ids"] > 0).astype(np.int32))
    assert b["segment_ids"].dtype == np.int32
  assert any(a["segment_ids"].max() > 1 for a in apart)  # several documents a row
  with pytest.raises(ConfigError, match="segment_ids=false"):
    DataConfig(format="chat", segment_ids=False).validate()


def test_unshuffled_text_reads_documents_in_file_order(tmp_path):
  batch = next(dataset(text_cfg(tmp_path, shuffle=False)))
  first = batch["tokens"][0][batch["segment_ids"][0] == 1]
  assert BYTES.decode(first) == "doc 0 "


def test_processes_read_disjoint_shards_covering_the_data(tmp_path):
  cfg = text_cfg(tmp_path)

  def docs_seen(process_index):
    it = dataset(cfg, process_index=process_index, process_count=2)
    texts = [BYTES.decode(piece) for batch in take(it, 10) for piece in pieces(batch)]
    return {t.split(" ")[1] for t in texts if t.startswith("doc ")}  # first pieces only

  seen0, seen1 = docs_seen(0), docs_seen(1)
  assert not seen0 & seen1
  assert seen0 | seen1 == {str(i) for i in range(40)}


def test_hf_tokenizer_pipeline_pads_with_its_pad_id(tmp_path, hf_tokenizer_path):
  (tmp_path / "c.txt").write_text("the cat sat\nthe dog ran far\n")
  cfg = DataConfig(source="text", path=str(tmp_path / "c.txt"), tokenizer=hf_tokenizer_path,
                   seq_len=16)
  tok = HFTokenizer(hf_tokenizer_path)
  batch = next(make_dataset(cfg, batch_size=2, seed=0, vocab_size=tok.vocab_size))
  assert np.all(batch["tokens"][batch["segment_ids"] == 0] == tok.pad_id)
  assert {tok.decode(p) for p in pieces(batch)} == {"the cat sat", "the dog ran far"}
  assert all(p[-1] == tok.eos_id for p in pieces(batch))


def test_tokenizer_larger_than_model_vocab_is_a_clear_error(hf_tokenizer_path):
  n = HFTokenizer(hf_tokenizer_path).vocab_size
  cfg = DataConfig(tokenizer=hf_tokenizer_path)
  with pytest.raises(ConfigError, match=f"vocab size {n} but model.vocab_size=5"):
    make_dataset(cfg, batch_size=2, seed=0, vocab_size=5)
  with pytest.raises(ConfigError, match="vocab size 260 but model.vocab_size=256"):
    make_dataset(DataConfig(), batch_size=2, seed=0, vocab_size=256)


def test_a_mask_id_the_data_can_hold_is_refused_before_reading(hf_tokenizer_path):
  with pytest.raises(ConfigError, match="objective.mask_token_id=257 is the EOS token"):
    make_dataset(DataConfig(), batch_size=2, seed=0, vocab_size=260, mask_token_id=257)
  cfg = DataConfig(tokenizer=hf_tokenizer_path)
  tok = HFTokenizer(hf_tokenizer_path)
  with pytest.raises(ConfigError, match=f"use objective.mask_token_id={tok.mask_id}"):
    make_dataset(cfg, batch_size=2, seed=0, vocab_size=tok.vocab_size, mask_token_id=tok.eos_id)
  assert next(make_dataset(cfg, batch_size=2, seed=0, vocab_size=tok.vocab_size,
                           mask_token_id=tok.mask_id))["tokens"].shape == (2, 128)


def test_a_document_spelling_out_the_mask_token_loses_it(tmp_path, hf_tokenizer_path):
  tok = HFTokenizer(hf_tokenizer_path)
  (tmp_path / "docs.txt").write_text("the [MASK] cat sat\n" * 4)
  assert tok.mask_id in tok.encode("the [MASK] cat sat")  # a tokenizer matches it in text
  cfg = DataConfig(source="text", path=str(tmp_path / "docs.txt"), tokenizer=hf_tokenizer_path,
                   seq_len=16)
  tokens = next(make_dataset(cfg, batch_size=2, seed=0, vocab_size=tok.vocab_size,
                             mask_token_id=tok.mask_id))["tokens"]
  assert tok.mask_id not in tokens
  assert tok.decode(tokens[0, :4].tolist()) == "the cat sat"


def test_text_the_tokenizer_cannot_encode_names_file_line_and_character(tmp_path):
  """A vocabulary without [UNK] cannot hold a character it never saw: the error says where."""
  tokenizer = save_word_level(tmp_path / "tokenizer.json", ["[PAD]", "[MASK]", "</s>"])
  (tmp_path / "c.txt").write_text("the cat sat\n\nthe \u2603 ran\n")
  cfg = DataConfig(source="text", path=str(tmp_path / "c.txt"), tokenizer=tokenizer,
                   seq_len=16, shuffle=False)
  with pytest.raises(DataError, match=rf"{tmp_path}/c.txt:3: data.tokenizer .*tokenizer.json "
                                      r"cannot encode '\u2603' \(characters 4-5 of the text; "
                                      r"no token holds '\u2603'\)"):
    next(make_dataset(cfg, batch_size=2, seed=0, vocab_size=260))


def test_more_processes_than_documents_is_a_clear_error(tmp_path):
  (tmp_path / "one.txt").write_text("only line\n")
  cfg = DataConfig(source="text", path=str(tmp_path / "one.txt"))
  with pytest.raises(ValueError, match="1 documents, too few .* 2 processes"):
    make_dataset(cfg, batch_size=2, seed=0, vocab_size=260, process_index=1, process_count=2)
