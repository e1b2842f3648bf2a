import pytest
import tokenizers

from bdlm_jax.config import ConfigError, DataConfig, ModelConfig, ObjectiveConfig
from bdlm_jax.data import ByteTokenizer, HFTokenizer, make_tokenizer


def test_byte_tokenizer_matches_default_config():
  tok = ByteTokenizer()
  assert tok.vocab_size == ModelConfig().vocab_size == 260
  assert tok.mask_id == ObjectiveConfig().mask_token_id == 259
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 257, 258)


def test_byte_tokenizer_round_trips_utf8():
  tok = ByteTokenizer()
  text = "12+3=15 héllo ∑ 🙂"
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text


def test_byte_decode_drops_or_names_special_ids():
  tok = ByteTokenizer()
  ids = tok.encode("1+1=2") + [tok.eos_id, tok.mask_id] + tok.encode("ok") + [tok.pad_id]
  assert tok.decode(ids) == "1+1=2ok"
  assert tok.decode(ids, skip_special=False) == "1+1=2<eos><mask>ok<pad>"


def test_hf_tokenizer_reads_local_tokenizer_json(hf_tokenizer_path):
  tok = HFTokenizer(hf_tokenizer_path)
  ids = tok.encode("the cat ran")
  assert len(ids) == 3 and max(ids) < tok.vocab_size
  assert tok.decode(ids) == "the cat ran"
  ids_of = tokenizers.Tokenizer.from_file(hf_tokenizer_path).token_to_id
  assert (tok.pad_id, tok.mask_id, tok.eos_id) == (ids_of("[PAD]"), ids_of("[MASK]"), ids_of("</s>"))
  assert tok.bos_id is None


def test_make_tokenizer_picks_by_config(hf_tokenizer_path, tmp_path):
  assert isinstance(make_tokenizer(DataConfig(tokenizer="byte")), ByteTokenizer)
  assert isinstance(make_tokenizer(DataConfig(tokenizer=hf_tokenizer_path)), HFTokenizer)
  # A folder holding tokenizer.json works too, as in a Hugging Face model folder.
  assert isinstance(make_tokenizer(DataConfig(tokenizer=str(tmp_path))), HFTokenizer)


def test_missing_tokenizer_file_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="no tokenizer.json found"):
    make_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")))


def test_unreadable_tokenizer_file_is_a_config_error(tmp_path):
  bad = tmp_path / "tokenizer.json"
  bad.write_text("{not json")
  with pytest.raises(ConfigError, match="cannot read Hugging Face tokenizer"):
    HFTokenizer(str(bad))
