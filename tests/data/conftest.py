"""Shared fixtures: a tiny Hugging Face tokenizer.json built on the spot (no download)."""

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

SPECIALS = ["[UNK]", "[PAD]", "[MASK]", "</s>"]
CORPUS = ["the cat sat", "the dog ran", "a cat ran far", "dogs and cats"]


@pytest.fixture
def hf_tokenizer_path(tmp_path):
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return str(path)
