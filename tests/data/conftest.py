"""Shared fixtures: a tiny Hugging Face tokenizer.json built on the spot (no download), and
a `gs://` bucket served from a local folder."""

import os

import pytest
import tokenizers
from etils.epath import testing as epath_testing
from tokenizers import models, pre_tokenizers, trainers

SPECIALS = ["[UNK]", "[PAD]", "[MASK]", "</s>"]
CORPUS = ["the cat sat", "the dog ran", "a cat ran far", "dogs and cats"]


def save_word_level(path, specials=SPECIALS, corpus=CORPUS) -> str:
  """A word-level tokenizer.json of `corpus` whose first ids are `specials`; returns its path."""
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
  tok.save(str(path))
  return str(path)


@pytest.fixture
def hf_tokenizer_path(tmp_path):
  return save_word_level(tmp_path / "tokenizer.json")


@pytest.fixture
def fake_gcs(tmp_path):
  """Every `gs://X` that etils.epath opens is the local `<folder>/X`; yields that folder.

  Code that bypasses epath (builtin `open`, `glob`, `os.path`) finds no such files.
  """
  root = tmp_path / "gcs"
  root.mkdir()
  local = lambda path: os.fspath(path).replace("gs://", f"{root}/", 1)
  remote = lambda path: os.fspath(path).replace(f"{root}/", "gs://", 1)
  on_local = lambda fn, path, *args, **kwargs: fn(local(path), *args, **kwargs)
  with epath_testing.mock_epath(open=on_local, exists=on_local, isdir=on_local, stat=on_local,
                                listdir=on_local,
                                glob=lambda fn, pattern: [remote(p) for p in fn(local(pattern))]):
    yield root
