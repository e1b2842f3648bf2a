"""The embedded default data: procedural arithmetic whose correctness can be checked.

Documents look like "37+5=42 12*3=36 90-17=73". Each is a pure function of (seed, index),
so the source is random-access, needs no download and has any size we like; and
`check_arithmetic` scores generated text, so a trained model can be tested against chance.
"""

from __future__ import annotations

import random
import re

_MAX_ADD = 99  # operands of + and - (results of - are kept non-negative)
_MAX_MUL = 12  # operands of * (times tables)
_STATEMENTS_PER_DOC = (4, 8)  # inclusive range
_STATEMENT = re.compile(r"(?<!\d)(\d+)([+*-])(\d+)=(\d+)(?!\d)")


def _statement(rng: random.Random) -> str:
  op = rng.choice("+-*")
  if op == "*":
    a, b = rng.randint(0, _MAX_MUL), rng.randint(0, _MAX_MUL)
    return f"{a}*{b}={a * b}"
  a, b = rng.randint(0, _MAX_ADD), rng.randint(0, _MAX_ADD)
  if op == "+":
    return f"{a}+{b}={a + b}"
  a, b = max(a, b), min(a, b)
  return f"{a}-{b}={a - b}"


class ArithmeticSource:
  """Grain random-access source of arithmetic documents, deterministic in (seed, index).

  `split="eval"` is the held-out split: documents drawn from another stream of the same seed
  (single statements recur across splits, as in any finite table; whole documents rarely do).
  """

  def __init__(self, seed: int = 0, size: int = 10**7, split: str = "train"):
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    self._key = f"{seed}" if split == "train" else f"eval:{seed}"
    self._size = size

  def __len__(self) -> int:
    return self._size

  def where(self, index: int) -> str:
    """Names document `index`, for error messages."""
    return f"embedded arithmetic document {index}"

  def __getitem__(self, index: int) -> str:
    if not 0 <= index < self._size:
      raise IndexError(f"index {index} out of range for ArithmeticSource of size {self._size}")
    rng = random.Random(f"{self._key}:{index}")  # str seeds hash stably (sha512)
    n = rng.randint(*_STATEMENTS_PER_DOC)
    return " ".join(_statement(rng) for _ in range(n))


def split_statement(statement: str) -> tuple[str, str]:
  """("a+b=", "c") from "a+b=c": a prompt and the answer it asks for."""
  question, _, answer = statement.rpartition("=")
  return question + "=", answer


def check_arithmetic(text: str) -> tuple[int, int]:
  """(correct, total) over the "a+b=c" / "a-b=c" / "a*b=c" statements found in `text`."""
  ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
  statements = _STATEMENT.findall(text)
  n_valid = sum(ops[op](int(a), int(b)) == int(c) for a, op, b, c in statements)
  return n_valid, len(statements)
