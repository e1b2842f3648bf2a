"""SFT chat data: prompts stay clean and unscored, examples are whole blocks, clear errors."""

import json

import jax
import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import Config, DataConfig
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ByteTokenizer, DataError, make_dataset
from bdlm_jax.data.chat import ChatSource
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
  _, inputs, _, _ = get_objective(objective).corrupt(jax.random.key(0), batch, L, cfg.objective)
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


def test_chat_format_needs_jsonl():
  with pytest.raises(ConfigError, match="data.source=jsonl"):
    replace(Config(), data=dict(format="chat", source="arithmetic"))
