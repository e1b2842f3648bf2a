import os

import pytest
import tokenizers

from bdlm_jax.config import DataConfig, ModelConfig, ObjectiveConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.data import ByteTokenizer, HFTokenizer, make_tokenizer
from bdlm_jax.data.tokenizers import check_mask_id, pick_mask_id
from tests.data.conftest import save_word_level


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


def test_hf_tokenizer_reads_a_gs_url_through_epath(hf_tokenizer_path, fake_gcs):
  (fake_gcs / "tok").mkdir()
  os.replace(hf_tokenizer_path, fake_gcs / "tok" / "tokenizer.json")
  tok = HFTokenizer("gs://tok")  # a folder holding tokenizer.json
  assert tok.decode(tok.encode("the cat")) == "the cat"


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


def test_a_mask_id_that_is_a_data_token_is_refused_with_a_free_one_named():
  byte = DataConfig(tokenizer="byte")
  for mask, said in [(257, "is the EOS token"), (256, "is the BOS token"),
                     (258, "is the PAD token"), (65, "is '<0x41>', a real token")]:
    with pytest.raises(ConfigError) as e:
      check_mask_id(ByteTokenizer(), byte, 260, mask)
    assert f"objective.mask_token_id={mask} {said} of data.tokenizer='byte'" in str(e.value)
    assert "use objective.mask_token_id=259" in str(e.value)
  check_mask_id(ByteTokenizer(), byte, 300, 259)  # its own [MASK]
  check_mask_id(ByteTokenizer(), byte, 300, 280)  # an embedding row no token uses


def test_hf_mask_id_may_be_its_mask_a_placeholder_or_an_unused_row(tmp_path):
  path = save_word_level(tmp_path / "tokenizer.json",
                         ["[UNK]", "[PAD]", "</s>", "<|reserved_special_token_0|>"])
  tok, cfg = HFTokenizer(path), DataConfig(tokenizer=path)
  ids_of = tokenizers.Tokenizer.from_file(path).token_to_id
  for ok in (ids_of("<|reserved_special_token_0|>"), tok.vocab_size):
    check_mask_id(tok, cfg, tok.vocab_size + 1, ok)
  with pytest.raises(ConfigError, match="is the PAD token .* use objective.mask_token_id=3"):
    check_mask_id(tok, cfg, tok.vocab_size, ids_of("[PAD]"))
  with pytest.raises(ConfigError, match=f"is 'cat', a real token .* use objective"
                                        f".mask_token_id={tok.vocab_size}$"):
    check_mask_id(tok, cfg, tok.vocab_size + 2, ids_of("cat"))


def test_pick_mask_id_prefers_its_mask_then_an_unused_row_then_a_placeholder(tmp_path,
                                                                            hf_tokenizer_path):
  with_mask = HFTokenizer(hf_tokenizer_path)
  assert pick_mask_id(with_mask, with_mask.vocab_size + 4) == with_mask.mask_id
  path = save_word_level(tmp_path / "tokenizer.json", ["[UNK]", "</s>", "<unused0>"])
  tok = HFTokenizer(path)
  assert pick_mask_id(tok, tok.vocab_size + 2) == tok.vocab_size  # a padded embedding
  assert pick_mask_id(tok, tok.vocab_size) == 2  # <unused0>
  assert pick_mask_id(HFTokenizer(save_word_level(tmp_path / "t2.json", ["[UNK]", "</s>"])),
                      tok.vocab_size - 1) is None  # every row is a token: grow the vocabulary
  assert pick_mask_id(ByteTokenizer(), 260) == 259


def test_the_fingerprint_is_the_id_to_token_mapping(tmp_path, hf_tokenizer_path):
  same = tmp_path / "copy" / "tokenizer.json"
  same.parent.mkdir()
  same.write_text(open(hf_tokenizer_path).read().replace('"version"', ' "version"'))
  other = save_word_level(tmp_path / "other.json", ["[UNK]", "[MASK]", "[PAD]", "</s>"])
  prints = [HFTokenizer(p).fingerprint for p in (hf_tokenizer_path, str(same), other)]
  assert prints[0] == prints[1] != prints[2] and prints[0].startswith("sha256:")
  assert ByteTokenizer().fingerprint == "byte"
