"""Packs token documents into fixed-length rows of L tokens with segment ids.

A document that fits in L stays whole: grain's first-fit packing pads a row rather than cut
a document across rows. Only a document longer than L is cut, into L-token pieces, each its
own segment. Segment ids number the documents of a row 1, 2, 3, ...; padding is segment 0.
`one_per_row` (data.pack=false) puts each document, or L-token piece of one, in a row of its
own, padded at the end. `one_stream` (data.segment_ids=false) makes a packed row's documents
one segment, the seed's continuous stream: everything before the row's end padding is id 1.
"""

from __future__ import annotations

import functools

import grain
import grain.experimental as gx
import numpy as np


class _SplitLong(gx.FlatMapTransform):
  """Cuts a document into pieces of at most `seq_len` tokens (first-fit cannot place more)."""

  def __init__(self, seq_len: int):
    self._seq_len = seq_len

  def flat_map(self, tokens_T: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{"tokens": tokens_T[i:i + self._seq_len]}
            for i in range(0, len(tokens_T), self._seq_len)]


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"]}


def pack(docs: grain.IterDataset, *, seq_len: int, pad_id: int,
         num_bins: int) -> grain.IterDataset:
  """int32 [T] documents -> {"tokens", "segment_ids"}: int32 [L] rows, padded with `pad_id`.

  `num_bins` rows fill at once; more bins waste less padding but hold more tokens in memory.
  """
  pieces = gx.FlatMapIterDataset(docs, _SplitLong(seq_len))
  rows = gx.FirstFitPackIterDataset(
      pieces, length_struct={"tokens": seq_len}, num_packing_bins=num_bins,
      shuffle_bins=False, padding_struct={"tokens": pad_id})
  return rows.map(_rename)


def _padded(seq_len: int, pad_id: int, piece: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  n = len(piece["tokens"])
  return {"tokens": np.concatenate([piece["tokens"], np.full(seq_len - n, pad_id, np.int32)]
                                   ).astype(np.int32),
          "segment_ids": (np.arange(seq_len) < n).astype(np.int32)}


def one_per_row(docs: grain.IterDataset, *, seq_len: int, pad_id: int,
                num_bins: int = 0) -> grain.IterDataset:
  """int32 [T] documents -> {"tokens", "segment_ids"}: int32 [L] rows, one document (or
  L-token piece of one) each, padded at the end with `pad_id` (segment 0); `num_bins` is
  unused (`pack`'s signature)."""
  del num_bins
  pieces = gx.FlatMapIterDataset(docs, _SplitLong(seq_len))
  return pieces.map(functools.partial(_padded, seq_len, pad_id))


def one_stream(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A packed row with its documents as one segment (id 1), padding still 0 (data.segment_ids=
  false: attention and Gated DeltaNet state cross the documents, as in the seed's stream)."""
  return {**row, "segment_ids": (row["segment_ids"] > 0).astype(np.int32)}
