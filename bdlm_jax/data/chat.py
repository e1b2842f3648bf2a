"""SFT data: records that say what is supervised -> block-aligned (tokens, protected)
examples, packed.

Records (`data.format=chat`, from JSONL, Parquet or a `datasets` folder; `example`):
* {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}: what is
  scored follows `data.supervise`: "assistant" every assistant message, "last" only the last
  one (which must come from the assistant either way), "all" every token. What is not scored
  is prompt, which the objectives never corrupt and never score (`protected`).
  `data.chat_template` "plain" and "chatml" are ours (each scored answer is followed by
  EOS); "tokenizer" is the `data.tokenizer` folder's own Jinja template (`FolderTemplate`),
  whose answers end as the template ends the turn: the template's `{% generation %}` blocks
  where it has them, else each assistant message's rendering after the generation prompt.
* {"prompt": str, "completion": str}: the completion (and EOS) is scored.
* {"input_ids": [int], "labels": [int]} (-100: not scored) or {"input_ids", "loss_mask"}:
  tokenized already; the ids must lie in the tokenizer's vocabulary.

Blocks must not straddle prompt and response, and blocks are counted from the start of
the packed row, so each run of prompt tokens is padded on the left and each response on the
right to whole blocks, with padding that is segment 0 (never attends, never attended,
never scored): to the model it does not exist, and every response starts on a block
boundary wherever the packer puts its example. An example longer than `data.seq_len` keeps
whole the turns that fit, then the start of the first response that does not, up to half the
row (whole blocks, one at least) or what the turns before it leave, and the end of what
precedes it: that is cut from the left, the rest of the conversation at the end (a response
is never dropped for its prompt, so every example trains). Rows carry what was cut
(`prompt_cut`: prompt tokens dropped, `response_cut`: response tokens not scored, at an
example's first token), which `Truncations` counts for the log.

`data.source=arithmetic` needs no file: each embedded arithmetic document gives one
conversation (`ArithmeticChatSource`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re

import grain
import grain.experimental as gx
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from etils import epath

from bdlm_jax.config import CHAT_TEMPLATES, DataConfig
from bdlm_jax.data.arithmetic import ArithmeticSource, split_statement
from bdlm_jax.data.sources import DataError, make_records
from bdlm_jax.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")

# (prefix, suffix) per role; a scored answer is `content` + EOS, after the assistant prefix
# (and before its suffix, when a message follows).
TEMPLATES = {
    "plain": {"system": ("System: ", "\n"), "user": ("User: ", "\n"),
              "assistant": ("Assistant: ", "\n"), "tool": ("Tool: ", "\n")},
    "chatml": {role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ROLES},
}
FOLDER = "tokenizer"  # data.chat_template naming the tokenizer folder's own template
assert CHAT_TEMPLATES == (*TEMPLATES, FOLDER)
# The special tokens transformers passes a template by name (`special_tokens_map`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
EOS = None  # a span (`example`) that is the tokenizer's end-of-document token
# Written around each `{% generation %}` block when a template is rendered to find them:
# private-use characters, which no message may hold.
OPEN, CLOSE = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`, transformers' tag marking assistant text for
  its assistant mask: renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _MarkedGeneration(jinja2.ext.Extension):
  """`{% generation %}` rendering its body between OPEN and CLOSE, so that the assistant text
  can be found in the rendering (transformers' `AssistantTracker` finds it by offsets)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

  def _mark(self, caller) -> str:
    return OPEN + caller() + CLOSE


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(text: str, marked: bool = False) -> jinja2.Template:
  """`text` compiled in transformers' chat-template environment (utils/chat_template_utils.py
  `_cached_compile_jinja_template`): sandboxed, trim_blocks and lstrip_blocks, loop controls,
  `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII and HTML characters;
  `marked`: its generation blocks between OPEN and CLOSE."""
  generation = _MarkedGeneration if marked else _Generation
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[generation, jinja2.ext.loopcontrols])
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
    self.marks_generation = _GENERATION_TAG.search(self.text) is not None
    try:
      _compile(self.text)
    except jinja2.TemplateSyntaxError as e:
      raise ConfigError(f"the chat template {self.source} is not valid Jinja: {e}") from e

  def __call__(self, messages: list[dict], add_generation_prompt: bool,
               marked: bool = False) -> str:
    """The template's text of `messages` (tools and documents None, as transformers passes
    them), its generation blocks between OPEN and CLOSE if `marked`; a DataError when the
    template refuses them (`raise_exception`)."""
    try:
      return _compile(self.text, marked).render(messages=messages, tools=None, documents=None,
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


def prompt_text(user_text: str, template: str | FolderTemplate) -> str:
  """The prompt a chat model sees for one user message (used by the sampler)."""
  user = [{"role": "user", "content": user_text}]
  if isinstance(template, FolderTemplate):
    return template(user, add_generation_prompt=True)
  return render(user + [{"role": "assistant", "content": ""}], template)[0]


def _spans(messages: list[dict], template: str | FolderTemplate,
           supervise: str) -> list[tuple[str | None, bool]]:
  """(text, scored) spans of a validated conversation, in order; text EOS: the EOS token."""
  if supervise == "last":
    prompt, response = render(messages, template)
    end = [] if isinstance(template, FolderTemplate) else [(EOS, True)]
    return [(prompt, False), (response, True), *end]
  if isinstance(template, FolderTemplate):
    if supervise == "all":
      return [(template(messages, add_generation_prompt=False), True)]
    if template.marks_generation:
      return _marked_spans(messages, template)
    return _turn_spans(messages, template)
  turns, spans = TEMPLATES[template], []
  for i, m in enumerate(messages):
    prefix, suffix = turns[m["role"]]
    if m["role"] == "assistant" and m["content"]:
      spans += [(prefix, False), (m["content"], True), (EOS, True)]
      spans += [(suffix, False)] if i + 1 < len(messages) else []
    else:
      spans.append((prefix + m["content"] + suffix, False))
  return [(text, True) for text, _ in spans] if supervise == "all" else spans


def _marked_spans(messages: list[dict], template: FolderTemplate) -> list[tuple[str, bool]]:
  """The spans of a template with `{% generation %}` blocks: those blocks are scored."""
  if any(OPEN in m["content"] or CLOSE in m["content"] for m in messages):
    raise DataError(f"a message holds U+E000 or U+E001, which mark the generation blocks of "
                    f"the chat template {template.source}")
  text = template(messages, add_generation_prompt=False, marked=True)
  marks = re.findall(f"[{OPEN}{CLOSE}]", text)
  if not marks or marks != [OPEN, CLOSE] * (len(marks) // 2):
    raise DataError(f"the chat template {template.source} renders "
                    f"{'no' if not marks else 'nested'} {{% generation %}} blocks for the "
                    f"conversation: no assistant text to score")
  return [(piece, i % 2 == 1) for i, piece in enumerate(re.split(f"[{OPEN}{CLOSE}]", text))]


def _turn_spans(messages: list[dict], template: FolderTemplate) -> list[tuple[str, bool]]:
  """The spans of a template without generation blocks: each non-empty assistant message is
  the rendering of the messages up to it after the rendering of those before it with the
  generation prompt, which must be a prefix of the whole conversation's rendering."""
  full, spans, at = template(messages, add_generation_prompt=False), [], 0
  for i, m in enumerate(messages):
    if m["role"] != "assistant" or not m["content"]:
      continue
    prompt = template(messages[:i], add_generation_prompt=True)
    turn = template(messages[:i + 1], add_generation_prompt=False)
    if not (turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= at):
      raise DataError(f"the chat template {template.source} renders messages 0..{i} as "
                      f"{turn!r}, which is not the generation prompt {prompt!r} followed by "
                      f"assistant message {i} and the start of the whole conversation's "
                      f"rendering: no turn split (data.supervise=last scores the last "
                      f"message alone)")
    spans += [(full[at:len(prompt)], False), (full[len(prompt):len(turn)], True)]
    at = len(turn)
  return spans + ([(full[at:], False)] if at < len(full) else [])


def _check_messages(messages, where: str, supervise: str) -> list[dict]:
  if not isinstance(messages, list) or not messages:
    raise DataError(f"chat record at {where} needs a non-empty 'messages' list")
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
      raise DataError(f"message {i} at {where} must be {{'role': one of {list(ROLES)}, "
                      f"'content': str}}, got {m!r}")
  if supervise != "all" and (messages[-1]["role"] != "assistant" or not messages[-1]["content"]):
    raise DataError(f"chat record at {where} has no assistant response: its last message "
                    f"must be a non-empty 'assistant' message")
  return messages


def _ids(record: dict, key: str, where: str) -> np.ndarray:
  """A tokenized record's list `key` as int64 [T] (booleans allowed: a loss mask)."""
  values = np.asarray(record[key])
  if values.ndim != 1 or not len(values) or not (np.issubdtype(values.dtype, np.integer)
                                                 or values.dtype == bool):
    raise DataError(f"'{key}' at {where} must be a non-empty list of integers, got "
                    f"{str(record[key])[:80]}")
  return values.astype(np.int64)


def _tokenized(record: dict, where: str, supervise: str) -> dict[str, np.ndarray]:
  """{"tokens", "scored"} of a record tokenized already (vocabulary: `prepare.tokenize`)."""
  masks = [k for k in ("labels", "loss_mask") if k in record]
  if len(masks) != 1:
    raise DataError(f"tokenized record at {where} needs 'input_ids' and one of 'labels' "
                    f"(-100: not scored) or 'loss_mask' (1: scored); it has {sorted(record)}")
  key = masks[0]
  tokens, mask = _ids(record, "input_ids", where), _ids(record, key, where)
  if len(mask) != len(tokens):
    raise DataError(f"'{key}' at {where} has {len(mask)} entries and 'input_ids' "
                    f"{len(tokens)}: they must match one to one")
  if key == "labels":
    scored = mask != -100
    wrong = np.flatnonzero(scored & (mask != tokens))
    if len(wrong):
      raise DataError(f"'labels' at {where} must be -100 or the input id at the same position "
                      f"(not shifted); position {wrong[0]} has label {mask[wrong[0]]} and "
                      f"input id {tokens[wrong[0]]}")
  elif not np.isin(mask, (0, 1)).all():
    raise DataError(f"'loss_mask' at {where} must hold 0 or 1 (false or true) only")
  else:
    scored = mask == 1
  scored = np.ones_like(scored) if supervise == "all" else scored
  if not scored.any():
    raise DataError(f"tokenized record at {where} scores no token")
  return {"tokens": tokens, "scored": scored}


def example(record, where: str, template: str | FolderTemplate, supervise: str) -> dict:
  """A record (module docstring) as {"spans": [(text, scored)]} (text EOS: the EOS token),
  which `prepare.tokenize` encodes, or, tokenized already, {"tokens", "scored"} [T]."""
  if not isinstance(record, dict):
    raise DataError(f"chat record at {where} must be an object, got {type(record).__name__}")
  record = {k: v for k, v in record.items() if v is not None}  # a table's empty columns
  if "messages" in record:
    messages = _check_messages(record["messages"], where, supervise)
    try:
      return {"spans": _spans(messages, template, supervise)}
    except DataError as e:
      raise DataError(f"chat record at {where}: {e}") from e
  if "prompt" in record or "completion" in record:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not (isinstance(prompt, str) and isinstance(completion, str) and completion):
      raise DataError(f"prompt/completion record at {where} needs a string 'prompt' and a "
                      f"non-empty string 'completion' (a conversation goes in 'messages')")
    return {"spans": [(prompt, supervise == "all"), (completion, True), (EOS, True)]}
  if "input_ids" in record:
    return _tokenized(record, where, supervise)
  raise DataError(f"chat record at {where} has no 'messages', 'prompt' and 'completion', or "
                  f"'input_ids' with 'labels' or 'loss_mask'; its keys: {sorted(record)}")


class ChatSource:
  """Records (`sources.make_records`: JSONL, Parquet or `datasets` rows) -> `example`s."""

  def __init__(self, records, template: str | FolderTemplate, supervise: str,
               messages_field: str = "messages"):
    self._records, self._template, self._supervise = records, template, supervise
    self._messages_field = messages_field
    for first in records.firsts():
      self[first]  # a wrong format fails at start-up, not hours in

  def __len__(self) -> int:
    return len(self._records)

  def where(self, index: int) -> str:
    return self._records.where(index)

  def __getitem__(self, index: int) -> dict:
    record = self._records[index]
    if isinstance(record, dict) and self._messages_field in record:
      record = {"messages": record.get(self._messages_field),
                **{k: v for k, v in record.items() if k != self._messages_field}}
    return example(record, self.where(index), self._template, self._supervise)


class ArithmeticChatSource:
  """The embedded arithmetic data as conversations: document i's first statement "a+b=c"
  becomes the user's "a+b=" and the assistant's "c". `split` picks the documents as
  ArithmeticSource does ("eval": another stream of the seed; single questions recur across
  splits, as statements do there)."""

  def __init__(self, seed: int, split: str, template: str | FolderTemplate,
               supervise: str = "assistant"):
    self._documents = ArithmeticSource(seed, split=split)
    self._template, self._supervise = template, supervise

  def __len__(self) -> int:
    return len(self._documents)

  def where(self, index: int) -> str:
    return self._documents.where(index)

  def messages(self, index: int) -> list[dict]:
    """Conversation `index` as a chat record's "messages"."""
    question, answer = split_statement(self._documents[index].split(" ")[0])
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

  def __getitem__(self, index: int) -> dict:
    return {"spans": _spans(self.messages(index), self._template, self._supervise)}


def make_chat_source(data_cfg: DataConfig, seed: int, split: str):
  """The chat records of `split` as `example`s, or the embedded arithmetic."""
  if data_cfg.source == "arithmetic":
    return ArithmeticChatSource(seed, split, make_template(data_cfg), data_cfg.supervise)
  return ChatSource(make_records(data_cfg, split), make_template(data_cfg), data_cfg.supervise,
                    data_cfg.messages_field)


def align(pad_id: int, block_size: int, seq_len: int,
          ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """An example's {"tokens", "scored"} [T] (`prepare.tokenize`) -> arrays [T'], T' a multiple
  of `block_size` and at most `seq_len`: tokens, protected, real (not padding), and the prompt
  tokens dropped and response tokens not scored (`prompt_cut`, `response_cut`, at [0]): each
  run of prompt tokens padded on the left to whole blocks, each response on the right, then
  the window the module docstring describes."""
  tokens, scored = ids["tokens"], ids["scored"]
  runs = np.split(np.arange(len(tokens)), np.flatnonzero(np.diff(scored)) + 1)
  rooms = [len(run) + -len(run) % block_size for run in runs]  # whole blocks
  starts = np.cumsum([0] + rooms)  # of each run's room in the aligned example
  at = np.full(starts[-1], -1)  # aligned position -> token index, -1: padding
  for run, start, room in zip(runs, starts, rooms):
    at[start + (0 if scored[run[0]] else room - len(run)):][:len(run)] = run
  begin, end = 0, len(at)
  if end > seq_len:  # keep up to the first response that overflows, its start and what precedes
    end = seq_len
    for run, start, room in zip(runs, starts, rooms):
      if scored[run[0]] and start + room > seq_len:
        half = max(block_size, seq_len // 2 // block_size * block_size)
        end = start + min(room, max(seq_len - start, half))
        break
    begin = max(0, end - seq_len)
  kept = at[begin:end]
  real = kept >= 0
  was_scored = real & scored[np.maximum(kept, 0)]
  kept_scored = was_scored.copy()
  if begin and at[begin - 1] >= 0 and scored[at[begin - 1]]:  # a response lost its start:
    kept_scored[:len(kept) if was_scored.all() else np.argmin(was_scored)] = False  # context
  cut = lambda n: np.pad([n], (0, len(kept) - 1)).astype(np.int32)
  return {"tokens": np.where(real, tokens[np.maximum(kept, 0)], pad_id).astype(np.int32),
          "protected": ~kept_scored, "real": real,
          "prompt_cut": cut(np.count_nonzero(~scored) - np.count_nonzero(real & ~was_scored)),
          "response_cut": cut(np.count_nonzero(scored) - np.count_nonzero(kept_scored))}


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
