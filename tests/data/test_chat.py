"""SFT chat data: prompts stay clean and unscored, examples are whole blocks, clear errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import Config, DataConfig
from bdlm_jax.configure import load_config, replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ByteTokenizer, DataError, check_arithmetic, make_dataset
from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf
from bdlm_jax.data.chat import (ChatSource, FolderTemplate, Truncations, align, example,
                                make_template, prompt_text, render)
from bdlm_jax.data.sources import JsonlRecords
from bdlm_jax.evaluate import arithmetic_prompts
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import init_params
from tests.data.conftest import CORPUS, save_word_level

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, L = 4, 128
CONVERSATIONS = [
    [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello there"}],
    [{"role": "user", "content": "3*4="}, {"role": "assistant", "content": "12"},
     {"role": "user", "content": "and 5*5?"}, {"role": "assistant", "content": "25"}],
]


def turns(*ids):
  """An example's {"tokens", "scored"} from its runs of ids: prompt, response, prompt, ..."""
  return {"tokens": np.concatenate(ids),
          "scored": np.repeat(np.arange(len(ids)) % 2 == 1, list(map(len, ids)))}


def _write(tmp_path, records, name="chat.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
  return str(path)


def _chat_cfg(path, **data):
  return DataConfig(source="jsonl", path=path, format="chat", seq_len=L, shuffle=False, **data)


@pytest.fixture
def chat_batch(tmp_path):
  data = make_dataset(_chat_cfg(_write(tmp_path, CONVERSATIONS)), batch_size=2, seed=0,
                      vocab_size=260, block_size=B)
  return next(data)


def test_chat_batches_mark_exactly_the_prompts_protected(chat_batch):
  tok = ByteTokenizer()
  tokens, seg, protected = chat_batch["tokens"], chat_batch["segment_ids"], chat_batch["protected"]
  assert protected.shape == tokens.shape and protected.dtype == bool
  responses = [tok.decode(tokens[r][(seg[r] == s) & ~protected[r]], skip_special=False)
               for r in range(len(tokens)) for s in np.unique(seg[r][seg[r] > 0])]
  assert set(responses) == {"19<eos>", "hello there<eos>", "12<eos>25<eos>"}  # data repeats
  prompts = [tok.decode(tokens[r][(seg[r] == s) & protected[r]])
             for r in range(len(tokens)) for s in np.unique(seg[r][seg[r] > 0])]
  assert "User: 3*4=\nAssistant: \nUser: and 5*5?\nAssistant: " in prompts


def test_examples_are_whole_blocks_so_no_block_mixes_prompt_and_response(chat_batch):
  seg, protected = chat_batch["segment_ids"], chat_batch["protected"]
  prompt = ((seg > 0) & protected).reshape(len(seg), -1, B)
  response = ((seg > 0) & ~protected).reshape(len(seg), -1, B)
  assert response.any() and not (prompt.any(-1) & response.any(-1)).any()
  # Each document's blocks are its own: a block never holds two documents.
  docs_per_block = [len(set(b[b > 0])) for b in seg.reshape(-1, B)]
  assert max(docs_per_block) == 1
  # Responses start on a block boundary (prompts are padded on the left to whole blocks).
  for row_seg, row_response in zip(seg, response.reshape(len(seg), -1)):
    for s in np.unique(row_seg[row_seg > 0]):
      assert np.flatnonzero((row_seg == s) & row_response)[0] % B == 0


@pytest.mark.parametrize("objective", ["bd3lm", "fast_dllm_v2"])
def test_prompt_tokens_are_never_masked_and_never_in_the_loss(chat_batch, objective):
  cfg = replace(Config(), data=dict(seq_len=L),
                objective=dict(name=objective, block_size=B, eps_min=1.0, eps_max=1.0))
  batch = make_batch(cfg, chat_batch["tokens"], chat_batch["segment_ids"],
                     chat_batch["protected"])
  noisy_pos = batch.pos[:, :L]  # strategy none: noisy rows are positions 0..L-1
  prompt = np.take_along_axis(chat_batch["protected"] | (chat_batch["segment_ids"] == 0),
                              noisy_pos, 1)
  assert not batch.maskable[:, :L][prompt].any()
  _, inputs, _, _ = get_objective(objective).corrupt(jax.random.key(0), batch, cfg)
  inputs = np.asarray(inputs)  # [copies * S, R]
  masked = (inputs == cfg.objective.mask_token_id).reshape(len(prompt), -1, 2 * L)[..., :L]
  assert masked.any() and not (masked & prompt[:, None]).any()
  # Labels are exactly the response tokens (shifted by one row for fast_dllm_v2, whose first
  # token of a block is labelled on the clean row before it).
  targets = batch.labels[batch.labels >= 0]
  response = chat_batch["tokens"][~chat_batch["protected"] & (chat_batch["segment_ids"] > 0)]
  assert sorted(targets.tolist()) == sorted(response.tolist())


def test_record_without_assistant_response_is_a_data_error_naming_file_and_line(tmp_path):
  bad = CONVERSATIONS[:2] + [[{"role": "user", "content": "unanswered"}]]
  path = _write(tmp_path, bad)
  with pytest.raises(DataError, match=f"{path}:3 has no assistant response"):
    ChatSource(JsonlRecords(path), "plain", "assistant")[2]
  first_bad = _write(tmp_path, [[{"role": "assistant", "content": ""}]], "first.jsonl")
  with pytest.raises(DataError, match=f"{first_bad}:1 has no assistant response"):
    make_dataset(_chat_cfg(first_bad), batch_size=2, seed=0, vocab_size=260, block_size=B)


def test_chat_format_needs_jsonl_or_arithmetic():
  with pytest.raises(ConfigError, match="data.source=jsonl"):
    replace(Config(), data=dict(format="chat", source="text", path="corpus.txt"))


def _conversations(batch):
  """(prompt, response) text of every conversation of a batch."""
  tok, found = ByteTokenizer(), []
  for tokens, seg, protected in zip(batch["tokens"], batch["segment_ids"], batch["protected"]):
    for s in np.unique(seg[seg > 0]):
      found.append((tok.decode(tokens[(seg == s) & protected]),
                    tok.decode(tokens[(seg == s) & ~protected], skip_special=False)))
  return found


def test_arithmetic_chat_protects_questions_and_holds_out_its_eval_split():
  cfg = replace(Config(), data=dict(source="arithmetic", format="chat", seq_len=64))
  train, held = (_conversations(next(make_dataset(cfg.data, batch_size=2, seed=0,
                                                  vocab_size=260, block_size=B, split=split)))
                 for split in ("train", "eval"))
  for prompt, response in train + held:
    assert prompt.startswith("User: ") and prompt.endswith("=\nAssistant: ")
    assert response.endswith("<eos>")
    question = prompt.removeprefix("User: ").removesuffix("\nAssistant: ")
    assert check_arithmetic(question + response.removesuffix("<eos>")) == (1, 1)
  assert len(train) >= 4 and set(train) != set(held)  # (single questions may recur)


def test_arithmetic_chat_eval_prompts_are_questions_as_the_sampler_templates_them():
  cfg = replace(Config(), data=dict(source="arithmetic", format="chat", chat_template="chatml"))
  for prompt, answer in arithmetic_prompts(cfg, 20):
    question = prompt.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
    assert prompt == prompt_text(question, "chatml")
    assert check_arithmetic(question + answer) == (1, 1)


# A tokenizer folder's own chat template (data.chat_template=tokenizer), Gemma's turn format.
# Its generation prompt is written with plain block tags, so what it renders depends on the
# environment transformers gives templates (trim_blocks, lstrip_blocks).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = "" -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
  {%- endif -%}
  {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
  {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
  {{- message['content'] | trim -}}
  {{ '<end_of_turn>\\n' }}
{%- endfor %}
  {% if add_generation_prompt %}
<start_of_turn>model
  {% endif %}
"""
GEMMA_SPECIALS = ["[UNK]", "[PAD]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"},
     {"role": "assistant", "content": "sat"}, {"role": "user", "content": "a dog"},
     {"role": "assistant", "content": " ran far "}],
    [{"role": "user", "content": "dogs and cats"}, {"role": "assistant", "content": "the dog"}],
]


@pytest.fixture
def gemma_folder(tmp_path):
  """A tokenizer folder with Gemma's chat template (one special token as an AddedToken
  dict, as transformers 4 saved them)."""
  folder = tmp_path / "gemma"
  folder.mkdir()
  save_word_level(folder / "tokenizer.json", GEMMA_SPECIALS,
                  CORPUS + ["user model be brief"])
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<bos>", "pad_token": "[PAD]", "chat_template": GEMMA_TEMPLATE,
      "eos_token": {"__type": "AddedToken", "content": "<eos>", "lstrip": False,
                    "normalized": False, "rstrip": False, "single_word": False,
                    "special": True}}))
  return str(folder)


def _ids_and_protected(batch):
  """{(ids, protected)} of every example of a batch."""
  return {(tuple(tokens[seg == s].tolist()), tuple(protected[seg == s].tolist()))
          for tokens, seg, protected in zip(batch["tokens"], batch["segment_ids"],
                                            batch["protected"])
          for s in np.unique(seg[seg > 0])}


@pytest.mark.parametrize("supervise", ["last", "assistant"])
def test_tokenizer_template_renders_and_tokenizes_as_transformers_does(gemma_folder, tmp_path,
                                                                       supervise):
  transformers = pytest.importorskip("transformers")
  reference = transformers.PreTrainedTokenizerFast.from_pretrained(gemma_folder)
  template = FolderTemplate(gemma_folder)
  ids_of = lambda messages, **kw: reference.apply_chat_template(messages, **kw)["input_ids"]
  expected = set()
  for messages in GEMMA_CONVERSATIONS:
    prompt, response = render(messages, template)
    assert prompt == reference.apply_chat_template(messages[:-1], tokenize=False,
                                                   add_generation_prompt=True)
    assert prompt + response == reference.apply_chat_template(messages, tokenize=False)
    ids, protected = ids_of(messages), np.ones(len(ids_of(messages)), bool)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    scored = answers if supervise == "assistant" else answers[-1:]
    text_of = lambda messages, **kw: reference.apply_chat_template(messages, tokenize=False, **kw)
    for i in scored:
      # A turn: what the messages up to it add to those before it with the generation prompt.
      protected[len(ids_of(messages[:i], add_generation_prompt=True)):
                len(ids_of(messages[:i + 1]))] = False
    expected.add((tuple(ids), tuple(protected.tolist())))
    spans = example({"messages": messages}, "here", template, supervise)["spans"]
    assert "".join(text for text, _ in spans) == text_of(messages)
    assert [text for text, is_scored in spans if is_scored] == [
        text_of(messages[:i + 1])[len(text_of(messages[:i], add_generation_prompt=True)):]
        for i in scored]
  # The batches hold exactly those ids: BOS as the template writes it, each response ending
  # with the turn's end (no EOS appended), and only the prompts protected.
  batch = next(make_dataset(_chat_cfg(_write(tmp_path, GEMMA_CONVERSATIONS), tokenizer=gemma_folder,
                                      chat_template="tokenizer", supervise=supervise),
                            batch_size=2, seed=0, vocab_size=64, block_size=B))
  assert _ids_and_protected(batch) == expected
  # The sampler's prompt for one user message is the template's, generation prompt included.
  user = [{"role": "user", "content": "a cat"}]
  assert prompt_text("a cat", template) == reference.apply_chat_template(
      user, tokenize=False, add_generation_prompt=True)


def test_import_hf_renders_chat_with_the_folder_s_template(gemma_folder, tmp_path):
  cfg = replace(Config(), model=dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2,
                                     n_kv_heads=1, head_dim=8, d_ff=32),
                objective=dict(mask_token_id=63))
  folder = str(tmp_path / "model")
  export_hf(init_params(cfg, jax.random.key(0)), cfg, folder)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(gemma_folder, name), folder)
  imported, _ = import_hf(folder)
  assert (imported.data.tokenizer, imported.data.chat_template) == (folder, "tokenizer")
  assert prompt_text("a cat", make_template(imported.data)).startswith(
      "<bos><start_of_turn>user\na cat<end_of_turn>\n")
  os.remove(os.path.join(folder, "tokenizer_config.json"))  # no template: ours stays
  assert import_hf(folder)[0].data.chat_template == "plain"


def test_tokenizer_template_errors_name_the_problem(gemma_folder, tmp_path):
  path = _write(tmp_path, CONVERSATIONS)
  with pytest.raises(ConfigError, match="data.tokenizer='byte' has none"):
    replace(Config(), data=dict(source="jsonl", path=path, format="chat",
                                chat_template="tokenizer"))
  bare = tmp_path / "bare"
  bare.mkdir()
  save_word_level(bare / "tokenizer.json")
  with pytest.raises(ConfigError, match=f"the folder {bare} .* has none"):
    make_dataset(_chat_cfg(path, tokenizer=str(bare / "tokenizer.json"),
                           chat_template="tokenizer"),
                 batch_size=2, seed=0, vocab_size=64, block_size=B)
  # The template refuses a conversation: the record is named.
  unpaired = _write(tmp_path, [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                {"role": "assistant", "content": "c"}]], "unpaired.jsonl")
  with pytest.raises(DataError, match=f"{unpaired}:1: .*roles must alternate"):
    ChatSource(JsonlRecords(unpaired), FolderTemplate(gemma_folder), "last")
  # chat_template.jinja comes first (as transformers reads a folder); this one's generation
  # prompt is no prefix of the conversation's rendering.
  (tmp_path / "gemma" / "chat_template.jinja").write_text(
      "{% for m in messages %}{{ m.content }};{% endfor %}"
      "{% if add_generation_prompt %}>{% endif %}")
  with pytest.raises(DataError, match=f"{path}:1: .*chat_template.jinja renders .* does not "
                                      f"start with"):
    ChatSource(JsonlRecords(path), FolderTemplate(gemma_folder), "last")


@pytest.mark.parametrize("pack", [True, False])
def test_a_prompt_longer_than_the_row_keeps_the_response_start_and_is_counted(tmp_path, pack):
  """Before: the example was cut to its first L tokens, all prompt; no response token was
  trained, and nothing said so. Now the prompt loses its start, the response keeps its own."""
  long = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "hello there"}]
  data = make_dataset(_chat_cfg(_write(tmp_path, [long, CONVERSATIONS[0]]), pack=pack),
                      batch_size=2, seed=0, vocab_size=260, block_size=B)
  batch, tok = next(data), ByteTokenizer()
  tokens, seg, protected = batch["tokens"], batch["segment_ids"], batch["protected"]
  responses = [tok.decode(tokens[r][(seg[r] == s) & ~protected[r]], skip_special=False)
               for r in range(len(tokens)) for s in np.unique(seg[r][seg[r] > 0])]
  assert sorted(responses) == ["19<eos>", "hello there<eos>"]
  prompts = [tok.decode(tokens[r][(seg[r] == s) & protected[r]])
             for r in range(len(tokens)) for s in np.unique(seg[r][seg[r] > 0])]
  prompt = "User: " + "x" * 300 + "\nAssistant: "
  kept = L - 12  # the response "hello there<eos>" is 3 blocks
  assert prompt[-kept:] in prompts
  counts = Truncations()
  counts.add(batch)
  assert counts.take() == dict(examples=2, truncated_examples=1,
                               prompt_tokens_cut=len(prompt) - kept, response_tokens_cut=0)


def test_a_response_only_cut_is_counted(tmp_path):
  """A short prompt whose response outruns the row: the prompt is whole, the response keeps
  the row's rest; the example counts as truncated, beside an uncut one."""
  long = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y" * 300}]
  data = make_dataset(_chat_cfg(_write(tmp_path, [long, CONVERSATIONS[0]]), pack=False),
                      batch_size=2, seed=0, vocab_size=260, block_size=B)
  batch = next(data)
  prompt = len("User: hi\nAssistant: ")  # 20 tokens, 5 whole blocks
  counts = Truncations()
  counts.add(batch)
  assert counts.take() == dict(examples=2, truncated_examples=1, prompt_tokens_cut=0,
                               response_tokens_cut=300 + 1 - (L - prompt))


def test_a_response_longer_than_half_the_row_keeps_half_and_the_prompt_s_end():
  prompt, response = np.arange(1, 101, dtype=np.int32), np.arange(101, 301, dtype=np.int32)
  ex = align(0, B, L, turns(prompt, response))
  assert len(ex["tokens"]) == L and ex["protected"].sum() == L // 2
  np.testing.assert_array_equal(ex["tokens"], np.concatenate([prompt[-64:], response[:64]]))
  assert (ex["prompt_cut"][0], ex["response_cut"][0]) == (36, 136)


GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<end_of_turn>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<end_of_turn>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_generation_blocks_are_what_transformers_masks_as_assistant(gemma_folder, tmp_path):
  """A template with `{% generation %}` blocks: the scored tokens are transformers'
  assistant mask, every turn's."""
  transformers = pytest.importorskip("transformers")
  config = json.loads((tmp_path / "gemma" / "tokenizer_config.json").read_text())
  (tmp_path / "gemma" / "tokenizer_config.json").write_text(
      json.dumps(dict(config, chat_template=GENERATION_TEMPLATE)))
  reference = transformers.PreTrainedTokenizerFast.from_pretrained(gemma_folder)
  expected = set()
  for messages in GEMMA_CONVERSATIONS:
    out = reference.apply_chat_template(messages, return_dict=True,
                                        return_assistant_tokens_mask=True)
    expected.add((tuple(out["input_ids"]), tuple(m == 0 for m in out["assistant_masks"])))
  batch = next(make_dataset(_chat_cfg(_write(tmp_path, GEMMA_CONVERSATIONS),
                                      tokenizer=gemma_folder, chat_template="tokenizer"),
                            batch_size=2, seed=0, vocab_size=64, block_size=B))
  assert _ids_and_protected(batch) == expected


def _scored_runs(batch, tok=ByteTokenizer()):
  """{prompt text of an example: [each run of its scored tokens, decoded]}; and every run
  starts and ends on a block boundary (or the example's end)."""
  found = {}
  for tokens, seg, protected in zip(batch["tokens"], batch["segment_ids"], batch["protected"]):
    for s in np.unique(seg[seg > 0]):
      at = np.flatnonzero(seg == s)
      scored = ~protected[at]
      starts = np.flatnonzero(np.diff(scored.astype(int), prepend=0) == 1)
      ends = np.flatnonzero(np.diff(scored.astype(int), append=0) == -1) + 1
      assert all(at[i] % B == 0 for i in starts)
      runs = [tok.decode(tokens[at[i:j]], skip_special=False) for i, j in zip(starts, ends)]
      found[tok.decode(tokens[at[~scored]])] = runs
  return found


MULTI_TURN = [{"role": "system", "content": "be brief"},
              {"role": "user", "content": "3*4="}, {"role": "assistant", "content": "12"},
              {"role": "user", "content": "and 5*5?"}, {"role": "assistant", "content": "25"},
              {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done!"}]


@pytest.mark.parametrize("supervise, runs", [
    ("assistant", ["12<eos>", "25<eos>", "done!<eos>"]),
    ("last", ["done!<eos>"]),
    ("all", ["System: be brief\nUser: 3*4=\nAssistant: 12<eos>\nUser: and 5*5?\nAssistant: "
             "25<eos>\nTool: ok\nAssistant: done!<eos>"])])
def test_each_assistant_turn_is_scored_from_a_block_boundary(tmp_path, supervise, runs):
  """Before, a multi-turn conversation trained on its last answer only (supervise=last)."""
  data = make_dataset(_chat_cfg(_write(tmp_path, [MULTI_TURN]), supervise=supervise),
                      batch_size=1, seed=0, vocab_size=260, block_size=B)
  found = _scored_runs(next(data))
  assert list(found.values()) == [runs]
  if supervise == "last":  # today's prompt: the earlier answers without EOS
    assert list(found) == ["System: be brief\nUser: 3*4=\nAssistant: 12\nUser: and 5*5?\n"
                           "Assistant: 25\nTool: ok\nAssistant: "]


def test_a_long_conversation_keeps_the_turns_that_fit_and_counts_the_rest():
  """Runs prompt 10, response 6, prompt 30, response 40 (B = 4, L = 48): aligned, they take
  12 + 8 + 32 + 40 rows; the second response overflows, so it keeps half the row (24) and
  what precedes it its last 24 (the second prompt's end); what is left out is counted."""
  p1, r1, p2, r2 = (np.arange(n, dtype=np.int32) + 1 + 100 * i
                    for i, n in enumerate((10, 6, 30, 40)))
  ex = align(0, B, 48, turns(p1, r1, p2, r2))
  np.testing.assert_array_equal(ex["tokens"], np.concatenate([p2[-24:], r2[:24]]))
  assert ex["protected"].tolist() == [True] * 24 + [False] * 24
  assert (ex["prompt_cut"][0], ex["response_cut"][0]) == (10 + 6, 6 + 16)
  # Row 96: both turns whole, each response from a block boundary, padding not real.
  ex = align(0, B, 96, turns(p1, r1, p2, r2))
  assert len(ex["tokens"]) == 12 + 8 + 32 + 40
  assert ex["real"].sum() == 86 and (ex["prompt_cut"][0], ex["response_cut"][0]) == (0, 0)
  assert np.flatnonzero(~ex["protected"]).tolist() == [*range(12, 18), *range(52, 92)]


def test_a_gated_deltanet_model_refuses_padding_between_turns():
  """Its layers restart their state after padding: a conversation's later turns would lose
  the earlier ones."""
  cfg = load_config(os.path.join(REPO, "configs", "qwen3_5_tiny.py"))
  with pytest.raises(ConfigError, match="data.supervise='assistant' pads between"):
    replace(cfg, data=dict(source="arithmetic", format="chat"))
  replace(cfg, data=dict(source="arithmetic", format="chat", supervise="last"))
