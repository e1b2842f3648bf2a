"""SFT chat data: JSONL `messages` -> block-aligned (tokens, protected) examples, packed.

A record is {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}. The
last message must come from the assistant: it is the response (followed by EOS); every
message before it, plus the assistant prefix of the template, is the prompt, which the
objectives never corrupt and never score (`protected`).

Blocks must not straddle prompt and response, and blocks are counted from the start of
the packed row, so every example is made a whole number of blocks: the prompt is padded
on the left, the response on the right, with padding that is segment 0 (never attends,
never attended, never scored): to the model it does not exist. Each example then starts
on a block boundary wherever the packer puts it. An example longer than `data.seq_len` is
cut to its first `seq_len` tokens (the prompt and the start of the response survive).

`data.source=arithmetic` needs no file: each embedded arithmetic document gives one
conversation (`ArithmeticChatSource`).
"""

from __future__ import annotations

import json

import grain
import grain.experimental as gx
import numpy as np

from bdlm_jax.config import CHAT_TEMPLATES, DataConfig
from bdlm_jax.data.arithmetic import ArithmeticSource, split_statement
from bdlm_jax.data.sources import DataError, TextLineSource, split_path

ROLES = ("system", "user", "assistant")

# (prefix, suffix) per role; the response is `content` + EOS, after the assistant prefix.
TEMPLATES = {
    "plain": {"system": ("System: ", "\n"), "user": ("User: ", "\n"),
              "assistant": ("Assistant: ", "\n")},
    "chatml": {role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ROLES},
}
assert tuple(TEMPLATES) == CHAT_TEMPLATES


def render(messages: list[dict], template: str) -> tuple[str, str]:
  """(prompt, response) text of a validated conversation."""
  turns = TEMPLATES[template]
  prompt = "".join(turns[m["role"]][0] + m["content"] + turns[m["role"]][1]
                   for m in messages[:-1])
  return prompt + turns["assistant"][0], messages[-1]["content"]


def prompt_text(user_text: str, template: str) -> str:
  """The prompt a chat model sees for one user message (used by the sampler)."""
  return render([{"role": "user", "content": user_text},
                 {"role": "assistant", "content": ""}], template)[0]


def _check_messages(record, where: str) -> list[dict]:
  messages = record.get("messages") if isinstance(record, dict) else None
  if not isinstance(messages, list) or not messages:
    raise DataError(f"chat record at {where} needs a non-empty 'messages' list")
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
      raise DataError(f"message {i} at {where} must be {{'role': one of {list(ROLES)}, "
                      f"'content': str}}, got {m!r}")
  if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
    raise DataError(f"chat record at {where} has no assistant response: its last message "
                    f"must be a non-empty 'assistant' message")
  return messages


class ChatSource(TextLineSource):
  """JSONL conversations -> {"prompt", "response"} text, validated with file:line errors."""

  def __init__(self, path: str, template: str):
    super().__init__(path)
    self._template = template
    for first in np.unique(self._rows_Nx4[:, 0], return_index=True)[1]:
      self[int(first)]  # a wrong format fails at start-up, not hours in

  def __getitem__(self, index: int) -> dict[str, str]:
    line = super().__getitem__(index)
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"invalid JSON at {self.where(index)}: {e}") from e
    prompt, response = render(_check_messages(record, self.where(index)), self._template)
    return {"prompt": prompt, "response": response}


class ArithmeticChatSource:
  """The embedded arithmetic data as conversations: document i's first statement "a+b=c"
  becomes the user's "a+b=" and the assistant's "c". `split` picks the documents as
  ArithmeticSource does ("eval": another stream of the seed; single questions recur across
  splits, as statements do there)."""

  def __init__(self, seed: int, split: str, template: str):
    self._documents = ArithmeticSource(seed, split=split)
    self._template = template

  def __len__(self) -> int:
    return len(self._documents)

  def where(self, index: int) -> str:
    return self._documents.where(index)

  def messages(self, index: int) -> list[dict]:
    """Conversation `index` as a chat record's "messages"."""
    question, answer = split_statement(self._documents[index].split(" ")[0])
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

  def __getitem__(self, index: int) -> dict[str, str]:
    prompt, response = render(self.messages(index), self._template)
    return {"prompt": prompt, "response": response}


def make_chat_source(data_cfg: DataConfig, seed: int, split: str):
  """The conversations of `split`: JSONL records, or the embedded arithmetic."""
  if data_cfg.source == "arithmetic":
    return ArithmeticChatSource(seed, split, data_cfg.chat_template)
  return ChatSource(split_path(data_cfg, split), data_cfg.chat_template)


def align(pad_id: int, block_size: int, seq_len: int,
          ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A conversation's {"prompt", "response"} ids (EOS ending the response) -> arrays [T], T a
  multiple of `block_size`: tokens, protected, real (not padding)."""
  prompt, response = ids["prompt"], ids["response"]
  left, right = -len(prompt) % block_size, -len(response) % block_size
  tokens = np.concatenate([np.full(left, pad_id, np.int32), prompt, response,
                           np.full(right, pad_id, np.int32)])
  protected = np.repeat([True, False, True], [left + len(prompt), len(response), right])
  real = np.repeat([False, True, False], [left, len(prompt) + len(response), right])
  return {"tokens": tokens[:seq_len], "protected": protected[:seq_len], "real": real[:seq_len]}


def _packed_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"tokens": row["tokens"], "protected": row["protected"],
          "segment_ids": np.where(row["real"], row["tokens_segment_ids"], 0).astype(np.int32)}


def pack_chat(examples: grain.IterDataset, *, seq_len: int, pad_id: int,
              num_bins: int) -> grain.IterDataset:
  """Examples -> {"tokens", "segment_ids", "protected"} rows [L]; padding is segment 0."""
  features = ("tokens", "protected", "real")
  rows = gx.FirstFitPackIterDataset(
      examples, length_struct={f: seq_len for f in features}, num_packing_bins=num_bins,
      shuffle_bins=False, padding_struct={"tokens": pad_id, "protected": True, "real": False})
  return rows.map(_packed_row)
