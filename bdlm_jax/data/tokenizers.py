"""Tokenizers behind one small interface, so the pipeline never cares which one it has.

`ByteTokenizer` needs no files and matches the default config (vocab 260, [MASK] = 259);
`HFTokenizer` reads a Hugging Face `tokenizer.json` from a local path (no network).
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import tokenizers as hf_tokenizers

from bdlm_jax.config import ConfigError, DataConfig

# Special tokens are found by name; the first name present wins.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
MASK_NAMES = ("<|mask|>", "<|mdm_mask|>", "|<MASK>|", "[MASK]", "<mask>")


class Tokenizer(Protocol):
  """What the pipeline and the sampler need from any tokenizer."""

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  mask_id: int | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes 0..255 plus BOS, EOS, PAD, MASK: the default, download-free vocabulary."""

  vocab_size = 260
  bos_id, eos_id, pad_id, mask_id = 256, 257, 258, 259
  _NAMES = {256: "<bos>", 257: "<eos>", 258: "<pad>", 259: "<mask>"}

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Bytes back to text; special ids are dropped, or shown as `<eos>` etc."""
    out, run = [], bytearray()
    for i in map(int, ids):
      if i < 256:
        run.append(i)
        continue
      out.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if not skip_special:
        out.append(self._NAMES.get(i, f"<{i}>"))
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (a file, or a folder holding one) read locally."""

  def __init__(self, path: str):
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise ConfigError(
          f"data.tokenizer={path!r}: no tokenizer.json found at {file}; use 'byte' or the "
          f"path of a Hugging Face tokenizer.json (or a folder holding one)")
    try:
      self._tok = hf_tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust library raises plain Exception subclasses
      raise ConfigError(f"data.tokenizer: cannot read Hugging Face tokenizer {file}: {e}") from e
    self.path = file
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1  # ids may have holes; this bounds them all
    self.bos_id = _first_present(vocab, BOS_NAMES)
    self.eos_id = _first_present(vocab, EOS_NAMES)
    pad_id = _first_present(vocab, PAD_NAMES)
    self.pad_id = self.eos_id if pad_id is None else pad_id  # padding is marked by segment 0
    self.mask_id = _first_present(vocab, MASK_NAMES)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def _first_present(vocab: dict[str, int], names: Sequence[str]) -> int | None:
  return next((vocab[n] for n in names if n in vocab), None)


def make_tokenizer(data_cfg: DataConfig) -> Tokenizer:
  """`data.tokenizer`: "byte", or a path to a Hugging Face tokenizer.json."""
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  return HFTokenizer(os.path.expanduser(data_cfg.tokenizer))
