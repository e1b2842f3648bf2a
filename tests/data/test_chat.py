"""SFT chat data: prompts stay clean and unscored, examples are whole blocks, clear errors."""

import json

import jax
import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import Config, DataConfig
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ByteTokenizer, DataError, check_arithmetic, make_dataset
from bdlm_jax.data.chat import ChatSource, prompt_text
from bdlm_jax.evaluate import arithmetic_prompts
from bdlm_jax.objectives import get_objective

B, L = 4, 128
CONVERSATIONS = [
    [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello there"}],
    [{"role": "user", "content": "3*4="}, {"role": "assistant", "content": "12"},
     {"role": "user", "content": "and 5*5?"}, {"role": "assistant", "content": "25"}],
]


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
  assert set(responses) == {"19<eos>", "hello there<eos>", "25<eos>"}  # data repeats
  prompts = [tok.decode(tokens[r][(seg[r] == s) & protected[r]])
             for r in range(len(tokens)) for s in np.unique(seg[r][seg[r] > 0])]
  assert "User: 3*4=\nAssistant: 12\nUser: and 5*5?\nAssistant: " in prompts


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
    ChatSource(path, "plain")[2]
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
