"""Tokenizers behind one small interface, so the pipeline never cares which one it has.

`ByteTokenizer` needs no files and matches the default config (vocab 260, [MASK] = 259);
`HFTokenizer` reads a Hugging Face `tokenizer.json` from a local path (no network).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Protocol, Sequence

import tokenizers as hf_tokenizers
from etils import epath

from bdlm_jax.config import DataConfig
from bdlm_jax.data.sources import DataError
from bdlm_jax.errors import ConfigError

# Special tokens are found by name; the first name present wins.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
MASK_NAMES = ("<|mask|>", "<|mdm_mask|>", "|<MASK>|", "[MASK]", "<mask>")
# Tokens a vocabulary reserves and a model never trains on (Llama 3, Gemma, BERT): a [MASK]
# may take one.
_PLACEHOLDER = re.compile(r"[<\[]\|?(reserved|unused)\w*\|?[>\]]")


class Tokenizer(Protocol):
  """What the pipeline and the sampler need from any tokenizer."""

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  mask_id: int | None
  fingerprint: str  # equal for two tokenizers with the same id -> token mapping

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

  def token_name(self, token_id: int) -> str | None:
    """The vocabulary entry of `token_id`, or None if no token has that id."""


class ByteTokenizer:
  """UTF-8 bytes 0..255 plus BOS, EOS, PAD, MASK: the default, download-free vocabulary."""

  vocab_size = 260
  bos_id, eos_id, pad_id, mask_id = 256, 257, 258, 259
  fingerprint = "byte"
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

  def token_name(self, token_id: int) -> str | None:
    return f"<0x{token_id:02X}>" if 0 <= token_id < 256 else self._NAMES.get(token_id)


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (a file, or a folder holding one; local or a URL)."""

  def __init__(self, path: str):
    given = epath.Path(path)
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
      raise ConfigError(
          f"data.tokenizer={path!r}: no tokenizer.json found at {file}; use 'byte' or the "
          f"path of a Hugging Face tokenizer.json (or a folder holding one)")
    try:
      self._tok = hf_tokenizers.Tokenizer.from_str(file.read_text())
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
    # The id -> token mapping alone: re-saving or moving the file keeps it.
    by_id = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    self.fingerprint = "sha256:" + hashlib.sha256(by_id.encode()).hexdigest()[:16]

  def encode(self, text: str) -> list[int]:
    """Token ids; DataError for text a vocabulary without an unknown token cannot hold."""
    try:
      return self._tok.encode(text, add_special_tokens=False).ids
    except Exception as e:  # the Rust library raises plain Exception subclasses
      raise DataError(f"data.tokenizer {self.path} cannot encode {self._unknown(text)}: "
                      f"{e}") from e

  def _unknown(self, text: str) -> str:
    """The first word (pre-tokenized piece) of `text` that fails to encode, where it is, and
    its characters that no token holds."""
    pre = self._tok.pre_tokenizer
    for piece, (start, end) in pre.pre_tokenize_str(text) if pre else [(text, (0, len(text)))]:
      try:
        self._tok.encode(piece, add_special_tokens=False)
      except Exception:  # pylint: disable=broad-except
        known = set("".join(self._tok.get_vocab(with_added_tokens=True)))
        unseen = ", ".join(repr(c) for c in dict.fromkeys(piece) if c not in known)
        return (f"{piece!r} (characters {start}-{end} of the text" +
                (f"; no token holds {unseen})" if unseen else ")"))
    return repr(text)

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def token_name(self, token_id: int) -> str | None:
    return self._tok.id_to_token(token_id) if token_id >= 0 else None


def _first_present(vocab: dict[str, int], names: Sequence[str]) -> int | None:
  return next((vocab[n] for n in names if n in vocab), None)


def pick_mask_id(tokenizer: Tokenizer, vocab_size: int) -> int | None:
  """A [MASK] id for a model with `vocab_size` embedding rows: the tokenizer's mask token,
  else the first row no token uses (Qwen2.5 pads its vocabulary), else the first reserved
  placeholder token; None if every row is a real token (the vocabulary must grow)."""
  if tokenizer.mask_id is not None and tokenizer.mask_id < vocab_size:
    return tokenizer.mask_id
  names = [tokenizer.token_name(i) for i in range(vocab_size)]
  unused = [i for i, n in enumerate(names) if n is None]
  placeholders = [i for i, n in enumerate(names) if n is not None and _PLACEHOLDER.fullmatch(n)]
  return next(iter(unused + placeholders), None)


def check_mask_id(tokenizer: Tokenizer, data_cfg: DataConfig, vocab_size: int,
                  mask_token_id: int) -> None:
  """[MASK] must be an id that no data token has: not BOS / EOS / PAD, not a real token.

  Free are the tokenizer's own mask, ids outside its vocabulary and reserved placeholders
  (text holding a placeholder's literal string is then refused by `make_batch`).
  """
  roles = {tokenizer.bos_id: "BOS", tokenizer.pad_id: "PAD", tokenizer.eos_id: "EOS"}
  role, name = roles.get(mask_token_id), tokenizer.token_name(mask_token_id)
  if role is None and (mask_token_id == tokenizer.mask_id or name is None or
                       _PLACEHOLDER.fullmatch(name)):
    return
  what = f"the {role} token" if role else f"{name!r}, a real token"
  pick = pick_mask_id(tokenizer, vocab_size)
  fix = (f"use objective.mask_token_id={pick}" if pick is not None else
         f"every id is taken: set model.vocab_size={vocab_size + 1} and "
         f"objective.mask_token_id={vocab_size} (a new embedding row)")
  raise ConfigError(f"objective.mask_token_id={mask_token_id} is {what} of data.tokenizer="
                    f"{data_cfg.tokenizer!r}, so masked and real tokens would look alike; {fix}")


def make_tokenizer(data_cfg: DataConfig) -> Tokenizer:
  """`data.tokenizer`: "byte", or a path to a Hugging Face tokenizer.json."""
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  return HFTokenizer(os.path.expanduser(data_cfg.tokenizer))
