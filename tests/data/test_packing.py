import grain
import numpy as np

from bdlm_jax.data.packing import pack

L, PAD = 8, -1


def packed_rows(docs, num_bins=2):
  ds = grain.MapDataset.source(docs).to_iter_dataset()
  return list(pack(ds, seq_len=L, pad_id=PAD, num_bins=num_bins))


def segments(row):
  seg = row["segment_ids"]
  return [row["tokens"][seg == s] for s in range(1, seg.max() + 1)]


def test_short_documents_stay_whole_and_apart():
  docs = [np.arange(n, dtype=np.int32) + 10 * n for n in (3, 5, 2, 7, 4, 1, 6, 8)]
  rows = packed_rows(docs)
  found = sorted(tuple(s) for row in rows for s in segments(row))
  assert found == sorted(tuple(d) for d in docs)


def test_rows_have_contiguous_segments_then_padding():
  docs = [np.full(n, n, dtype=np.int32) for n in (3, 5, 2, 7, 4, 1, 6)]
  for row in packed_rows(docs, num_bins=3):
    seg, tokens = row["segment_ids"], row["tokens"]
    assert seg.shape == tokens.shape == (L,) and seg.dtype == tokens.dtype == np.int32
    n_used = np.count_nonzero(seg)
    assert np.all(seg[:n_used] > 0) and np.all(seg[n_used:] == 0)  # padding only at the end
    assert np.all(tokens[n_used:] == PAD)
    assert seg[0] == 1 and set(np.diff(seg[:n_used])) <= {0, 1}  # 1, 2, 3, ... contiguous


def test_long_documents_are_cut_into_row_sized_pieces():
  long_doc = np.arange(100, 100 + 2 * L + 3, dtype=np.int32)
  docs = [np.array([1, 2], np.int32), long_doc, np.array([3], np.int32)]
  rows = packed_rows(docs)
  pieces = [s for row in rows for s in segments(row) if s[0] >= 100]
  assert sorted(len(p) for p in pieces) == [3, L, L]
  np.testing.assert_array_equal(np.sort(np.concatenate(pieces)), long_doc)
