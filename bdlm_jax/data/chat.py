"""SFT chat data: JSONL `messages` -> block-aligned (tokens, protected) examples, packed.

A record is {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}. The
last message must come from the assistant: it is the response; every message before it,
plus the assistant prefix of the template, is the prompt, which the objectives never
corrupt and never score (`protected`). `data.chat_template` "plain" and "chatml" are ours
(the response is followed by EOS); "tokenizer" is the `data.tokenizer` folder's own Jinja
template (`FolderTemplate`), whose response ends as the template ends the turn.

Blocks must not straddle prompt and response, and blocks are counted from the start of
the packed row, so every example is made a whole number of blocks: the prompt is padded
on the left, the response on the right, with padding that is segment 0 (never attends,
never attended, never scored): to the model it does not exist. Each example then starts
on a block boundary wherever the packer puts it. An example longer than `data.seq_len` keeps
the start of its response, up to half the row (whole blocks, one at least) or what the
prompt leaves, and the end of its prompt: the prompt is cut from the left, the response at
the end (never dropped, so every example trains). Rows carry what was cut (`prompt_cut`,
`response_cut`: at an example's first token), which `Truncations` counts for the log.

`data.source=arithmetic` needs no file: each embedded arithmetic document gives one
conversation (`ArithmeticChatSource`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import grain
import grain.experimental as gx
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from etils import epath

from bdlm_jax.config import CHAT_TEMPLATES, DataConfig
from bdlm_jax.data.arithmetic import ArithmeticSource, split_statement
from bdlm_jax.data.sources import DataError, TextLineSource, split_path
from bdlm_jax.errors import ConfigError

ROLES = ("system", "user", "assistant")

# (prefix, suffix) per role; the response is `content` + EOS, after the assistant prefix.
TEMPLATES = {
    "plain": {"system": ("System: ", "\n"), "user": ("User: ", "\n"),
              "assistant": ("Assistant: ", "\n")},
    "chatml": {role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ROLES},
}
FOLDER = "tokenizer"  # data.chat_template naming the tokenizer folder's own template
assert CHAT_TEMPLATES == (*TEMPLATES, FOLDER)
# The special tokens transformers passes a template by name (`special_tokens_map`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`, transformers' tag marking assistant text for
  its assistant mask: renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(text: str) -> jinja2.Template:
  """`text` compiled in transformers' chat-template environment (utils/chat_template_utils.py
  `_cached_compile_jinja_template`): sandboxed, trim_blocks and lstrip_blocks, loop controls,
  `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII and HTML characters."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(text)


def _read_json(file: epath.Path) -> dict:
  return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


class FolderTemplate:
  """The chat template of a Hugging Face tokenizer folder (`chat_template.jinja`, else
  `chat_template` in tokenizer_config.json): the format the model was trained with, rendered
  as transformers' `apply_chat_template` renders it, its special tokens (`bos_token`, ...)
  passed by name. Holds text only (compiled on use), so a spawned worker can take it."""

  def __init__(self, tokenizer: str):
    where = f"data.chat_template={FOLDER!r} renders with data.tokenizer's chat template, but"
    if tokenizer == "byte":
      raise ConfigError(f"{where} data.tokenizer='byte' has none: set data.tokenizer to a "
                        f"Hugging Face tokenizer folder with a chat template, or use "
                        f"data.chat_template={'/'.join(TEMPLATES)}")
    given = epath.Path(os.path.expanduser(tokenizer))
    folder = given if given.is_dir() else given.parent
    config = _read_json(folder / "tokenizer_config.json")
    self.text, self.source = _template_text(folder, config)
    if self.text is None:
      raise ConfigError(f"{where} the folder {folder} of data.tokenizer={tokenizer!r} has "
                        f"none (no chat_template.jinja, no 'chat_template' in "
                        f"tokenizer_config.json); use data.chat_template="
                        f"{'/'.join(TEMPLATES)}")
    legacy = _read_json(folder / "special_tokens_map.json")
    found = {name: config.get(name, legacy.get(name)) for name in SPECIAL_TOKENS}
    self.special_tokens = {name: _content(t) for name, t in found.items() if t is not None}
    try:
      _compile(self.text)
    except jinja2.TemplateSyntaxError as e:
      raise ConfigError(f"the chat template {self.source} is not valid Jinja: {e}") from e

  def __call__(self, messages: list[dict], add_generation_prompt: bool) -> str:
    """The template's text of `messages` (tools and documents None, as transformers passes
    them); a DataError when the template refuses them (`raise_exception`)."""
    try:
      return _compile(self.text).render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
    except jinja2.TemplateError as e:
      raise DataError(f"the chat template {self.source} refuses the conversation: {e}") from e


def _template_text(folder: epath.Path, config: dict) -> tuple[str | None, str]:
  """(template, where it is) of a tokenizer folder, as transformers picks it: the .jinja file
  first; tokenizer_config.json's may be one string or a list of named ones ("default")."""
  jinja_file = folder / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
  where, text = str(folder / "tokenizer_config.json"), config.get("chat_template")
  if isinstance(text, list):
    named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
    if "default" not in named:
      raise ConfigError(f"{where} has chat templates {sorted(map(str, named))} but no "
                        f"'default' one to render conversations with")
    text = named["default"]
  if text is not None and not isinstance(text, str):
    raise ConfigError(f"{where}: 'chat_template' must be a string, got {type(text).__name__}")
  return text, where


def has_template(folder: str) -> bool:
  """Whether a tokenizer folder carries a chat template (`import_hf` then renders with it)."""
  folder = epath.Path(folder)
  return ((folder / "chat_template.jinja").is_file() or
          _read_json(folder / "tokenizer_config.json").get("chat_template") is not None)


def _content(token) -> str:
  """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
  return str(token["content"] if isinstance(token, dict) else token)


def make_template(data_cfg: DataConfig) -> str | FolderTemplate:
  """`data.chat_template` as `render` takes it: a name of TEMPLATES, or the folder's own."""
  if data_cfg.chat_template == FOLDER:
    return FolderTemplate(data_cfg.tokenizer)
  return data_cfg.chat_template


def render(messages: list[dict], template: str | FolderTemplate) -> tuple[str, str]:
  """(prompt, response) text of a validated conversation. With a folder's template: the
  rendering of every message before the response with the generation prompt, and the rest
  of the rendering of all messages (the response and how the template ends its turn)."""
  if isinstance(template, FolderTemplate):
    prompt = template(messages[:-1], add_generation_prompt=True)
    full = template(messages, add_generation_prompt=False)
    if not full.startswith(prompt):
      raise DataError(f"the chat template {template.source} renders the conversation "
                      f"{full!r}, which does not start with its rendering of the messages "
                      f"before the response {prompt!r}: no prompt/response split")
    return prompt, full[len(prompt):]
  if template not in TEMPLATES:
    raise ConfigError(f"chat template {template!r}: one of {list(TEMPLATES)}, or a "
                      f"FolderTemplate (make_template(data_cfg) for {FOLDER!r})")
  turns = TEMPLATES[template]
  prompt = "".join(turns[m["role"]][0] + m["content"] + turns[m["role"]][1]
                   for m in messages[:-1])
  return prompt + turns["assistant"][0], messages[-1]["content"]


def conversation(messages: list[dict], template: str | FolderTemplate) -> dict:
  """A chat source's example: {"prompt", "response"} text, and "add_eos" (whether
  `tokenize` ends the response with EOS: our templates; a folder's ends its turn itself)."""
  prompt, response = render(messages, template)
  return {"prompt": prompt, "response": response,
          "add_eos": not isinstance(template, FolderTemplate)}


def prompt_text(user_text: str, template: str | FolderTemplate) -> str:
  """The prompt a chat model sees for one user message (used by the sampler)."""
  user = [{"role": "user", "content": user_text}]
  if isinstance(template, FolderTemplate):
    return template(user, add_generation_prompt=True)
  return render(user + [{"role": "assistant", "content": ""}], template)[0]


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
  """JSONL conversations -> `conversation` examples, validated with file:line errors."""

  def __init__(self, path: str, template: str | FolderTemplate):
    super().__init__(path)
    self._template = template
    for first in np.unique(self._rows_Nx4[:, 0], return_index=True)[1]:
      self[int(first)]  # a wrong format fails at start-up, not hours in

  def __getitem__(self, index: int) -> dict:
    line = super().__getitem__(index)
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"invalid JSON at {self.where(index)}: {e}") from e
    messages = _check_messages(record, self.where(index))
    try:
      return conversation(messages, self._template)
    except DataError as e:
      raise DataError(f"chat record at {self.where(index)}: {e}") from e


class ArithmeticChatSource:
  """The embedded arithmetic data as conversations: document i's first statement "a+b=c"
  becomes the user's "a+b=" and the assistant's "c". `split` picks the documents as
  ArithmeticSource does ("eval": another stream of the seed; single questions recur across
  splits, as statements do there)."""

  def __init__(self, seed: int, split: str, template: str | FolderTemplate):
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

  def __getitem__(self, index: int) -> dict:
    return conversation(self.messages(index), self._template)


def make_chat_source(data_cfg: DataConfig, seed: int, split: str):
  """The conversations of `split`: JSONL records, or the embedded arithmetic."""
  if data_cfg.source == "arithmetic":
    return ArithmeticChatSource(seed, split, make_template(data_cfg))
  return ChatSource(split_path(data_cfg, split), make_template(data_cfg))


def align(pad_id: int, block_size: int, seq_len: int,
          ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A conversation's {"prompt", "response"} ids (`tokenize`) -> arrays [T], T a multiple of
  `block_size` and at most `seq_len`: tokens, protected, real (not padding), and the prompt
  and response tokens cut to fit (`prompt_cut`, `response_cut`, at [0]; see above)."""
  prompt, response = ids["prompt"], ids["response"]
  left, right = -len(prompt) % block_size, -len(response) % block_size
  prompt_room, response_room = left + len(prompt), len(response) + right  # whole blocks
  if prompt_room + response_room > seq_len:
    half = max(block_size, seq_len // 2 // block_size * block_size)
    response_room = min(response_room, max(seq_len - prompt_room, half))
    prompt_room = seq_len - response_room
  kept_prompt, kept_response = min(len(prompt), prompt_room), min(len(response), response_room)
  pad = lambda n: np.full(n, pad_id, np.int32)
  tokens = np.concatenate([pad(prompt_room - kept_prompt), prompt[len(prompt) - kept_prompt:],
                           response[:kept_response], pad(response_room - kept_response)])
  protected = np.repeat([True, False, True],
                        [prompt_room, kept_response, response_room - kept_response])
  real = np.repeat([False, True, False], [prompt_room - kept_prompt, kept_prompt + kept_response,
                                          response_room - kept_response])
  cut = lambda n: np.pad([n], (0, len(tokens) - 1)).astype(np.int32)
  return {"tokens": tokens, "protected": protected, "real": real,
          "prompt_cut": cut(len(prompt) - kept_prompt),
          "response_cut": cut(len(response) - kept_response)}


CUTS = ("prompt_cut", "response_cut")


class Truncations:
  """What `align` cut from the conversations of the batches read since the last `take`
  (nothing to count, and no counts, for text data)."""

  def __init__(self):
    self._counts = dict(examples=0, truncated_examples=0, prompt_tokens_cut=0,
                        response_tokens_cut=0)
    self._chat = False

  def add(self, batch: dict[str, np.ndarray]) -> None:
    if CUTS[0] not in batch:
      return
    self._chat = True
    prompt, response = batch["prompt_cut"], batch["response_cut"]
    self._counts["examples"] += sum(len(np.unique(row[row > 0])) for row in batch["segment_ids"])
    self._counts["truncated_examples"] += int(np.count_nonzero(prompt + response))
    self._counts["prompt_tokens_cut"] += int(prompt.sum())
    self._counts["response_tokens_cut"] += int(response.sum())

  def peek(self) -> dict[str, int]:
    return dict(self._counts)

  def take(self) -> dict[str, int]:
    """The counts since the last call, then zeros."""
    counts = self._counts
    self._counts = dict.fromkeys(counts, 0)
    return counts if self._chat else {}


def _packed_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"tokens": row["tokens"], "protected": row["protected"],
          "segment_ids": np.where(row["real"], row["tokens_segment_ids"], 0).astype(np.int32),
          **{k: row[k] for k in CUTS}}


def pack_chat(examples: grain.IterDataset, *, seq_len: int, pad_id: int,
              num_bins: int) -> grain.IterDataset:
  """Examples -> {"tokens", "segment_ids", "protected", *CUTS} rows [L]; padding is segment 0."""
  features = ("tokens", "protected", "real", *CUTS)
  rows = gx.FirstFitPackIterDataset(
      examples, length_struct={f: seq_len for f in features}, num_packing_bins=num_bins,
      shuffle_bins=False, padding_struct={"tokens": pad_id, "protected": True, "real": False,
                                          **dict.fromkeys(CUTS, 0)})
  return rows.map(_packed_row)


def _padded_row(seq_len: int, pad_id: int, example: dict[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
  fill = seq_len - len(example["tokens"])
  pad = lambda x, value: np.concatenate([x, np.full(fill, value, x.dtype)])
  return {"tokens": pad(example["tokens"], pad_id), "protected": pad(example["protected"], True),
          "segment_ids": pad(example["real"], False).astype(np.int32),
          **{k: pad(example[k], 0) for k in CUTS}}


def chat_per_row(examples: grain.IterDataset, *, seq_len: int, pad_id: int,
                 num_bins: int = 0) -> grain.IterDataset:
  """Examples -> the same rows as `pack_chat`, one example each (data.pack=false), padded
  at the end; `num_bins` is unused."""
  del num_bins
  return examples.map(functools.partial(_padded_row, seq_len, pad_id))
