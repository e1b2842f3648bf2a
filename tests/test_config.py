"""Config: override parsing, config files, `replace`, and errors that name the bad key."""

import os
import textwrap

import pytest

from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, override, replace
from bdlm_jax.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart_bd3lm.py")


def test_overrides_parse_with_the_type_of_their_field():
  cfg = override(Config(), ["model.qk_norm=yes", "train.async_checkpoint=off", "train.steps=1_000",
                            "model.vocab_size=0x200", "train.warmup_steps=1e2", "train.lr=3e-4",
                            "train.grad_clip=2", "parallel.strategy=csbp_ring",
                            "data.path= spaced name.txt", "sample.checkpoint_step=-1"])
  assert cfg.model.qk_norm is True and cfg.train.async_checkpoint is False
  assert cfg.train.steps == 1000 and cfg.model.vocab_size == 512
  assert cfg.train.warmup_steps == 100 and type(cfg.train.warmup_steps) is int
  assert cfg.train.lr == 3e-4 and cfg.train.grad_clip == 2.0 and type(cfg.train.grad_clip) is float
  assert cfg.parallel.strategy == "csbp_ring" and cfg.data.path == " spaced name.txt"
  assert cfg.sample.checkpoint_step == -1


@pytest.mark.parametrize("value", ["true", "True", "1", "on", "YES"])
def test_true_spellings_parse_as_true(value):
  assert override(Config(), [f"model.qk_norm={value}"]).model.qk_norm is True


@pytest.mark.parametrize("item, expected", [
    ("train.steps=abc", "'train.steps' expects int, got 'abc'"),
    ("train.steps=2.5", "'train.steps' expects int"),  # not silently truncated to 2
    ("train.steps=True", "'train.steps' expects int"),
    ("train.lr=fast", "'train.lr' expects float, got 'fast'"),
    ("model.qk_norm=maybe", "'model.qk_norm' expects bool, got 'maybe'"),
])
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(item, expected):
  with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
    override(Config(), [item])


def test_a_misspelled_key_is_refused_with_the_close_spellings():
  with pytest.raises(ConfigError) as e:
    override(Config(), ["model.dmodel=64"])
  assert str(e.value).startswith("unknown config key 'model.dmodel'; did you mean "
                                 "'model.d_model'")


def test_a_key_with_no_close_spelling_says_where_the_keys_are():
  with pytest.raises(ConfigError, match="unknown config key 'zzz'; the sections of "
                                        "bdlm_jax/config.py list every key"):
    override(Config(), ["zzz=1"])


def test_a_misspelled_key_in_a_config_file_is_refused_with_the_close_spellings(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text("def get_config():\n  return {'train': {'step': 5}}\n")
  with pytest.raises(ConfigError, match=r"unknown config key 'train.step'; did you mean "
                                        r"'train.steps'"):
    load_config(str(path))


def test_an_override_without_equals_sign_shows_the_syntax():
  with pytest.raises(ConfigError, match="must look like key=value"):
    override(Config(), ["train.steps"])


def test_seq_len_must_be_a_multiple_of_the_block_size():
  with pytest.raises(ConfigError, match="data.seq_len=40 is not a multiple of "
                                        "objective.block_size=16"):
    override(Config(), ["data.seq_len=40"])


def test_an_unknown_strategy_lists_the_strategies():
  with pytest.raises(ConfigError, match=r"parallel.strategy='zigzag' is not one of .*csbp_ring"):
    override(Config(), ["parallel.strategy=zigzag"])


@pytest.mark.parametrize("pattern, expected", [
    ("local,global", "has local layers, whose model.sliding_window must be >= 1 position; got 0"),
    ("local,sliding", "has the layer type 'sliding'; valid types: ['global', 'local', 'gdn'], "
                      "comma-separated"),
])
def test_a_bad_layer_pattern_is_named(pattern, expected):
  with pytest.raises(ConfigError) as e:
    override(Config(), [f"model.layer_pattern={pattern}"])
  assert expected in str(e.value)


def test_an_unknown_mlp_activation_lists_the_activations():
  with pytest.raises(ConfigError,
                     match=r"model.mlp_activation='gelu' is not one of \['silu', 'gelu_tanh'\]"):
    override(Config(), ["model.mlp_activation=gelu"])


def test_override_does_not_touch_the_config_it_was_given():
  cfg = Config()
  override(cfg, ["train.steps=7"])
  assert cfg.train.steps == Config().train.steps


def test_load_config_runs_get_config_then_applies_overrides():
  cfg = load_config(QUICKSTART, ["train.steps=3"])
  assert cfg.train.steps == 3 and cfg.data.source == "arithmetic"


@pytest.mark.parametrize("body", [
    "from bdlm_jax.config import Config, TrainConfig\n"
    "def get_config():\n  return Config(train=TrainConfig(steps=5))\n",
    "def get_config():\n  return {'train': {'steps': 5}}\n",
])
def test_load_config_accepts_a_config_or_a_dict(tmp_path, body):
  path = tmp_path / "exp.py"
  path.write_text(body)
  assert load_config(str(path)).train.steps == 5


def test_a_dict_config_is_checked_like_an_override(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text("def get_config():\n  return {'train': {'stepz': 5}}\n")
  with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'; did you mean 'train.steps'"):
    load_config(str(path))


def test_a_config_file_without_get_config_is_refused(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text("CONFIG = {}\n")
  with pytest.raises(ConfigError, match="does not define get_config()"):
    load_config(str(path))


def test_a_missing_config_file_is_named(tmp_path):
  with pytest.raises(ConfigError, match="config file not found: .*nope.py"):
    load_config(str(tmp_path / "nope.py"))


def test_get_config_must_return_a_config(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text(textwrap.dedent("""
      def get_config():
        return 42
  """))
  with pytest.raises(ConfigError, match="must return a bdlm_jax Config"):
    load_config(str(path))


def test_replace_updates_sections_functionally_and_validates():
  cfg = Config()
  new = replace(cfg, model=dict(n_layers=4), train=dict(steps=9))
  assert (new.model.n_layers, new.train.steps, new.model.d_model) == (4, 9, cfg.model.d_model)
  assert cfg.model.n_layers == Config().model.n_layers
  with pytest.raises(ConfigError, match="is not a multiple of objective.block_size"):
    replace(cfg, data=dict(seq_len=100))
  with pytest.raises(ConfigError, match=r"unknown config key 'model.layers'; did you mean 'model.n_layers'"):
    replace(cfg, model=dict(layers=4))


def test_a_config_round_trips_through_a_dict():
  cfg = load_config(QUICKSTART, ["model.qk_norm=true", "parallel.strategy=bp"])
  assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("item, expected", [
    ("train.lr=0", "train.lr must be > 0, got 0.0"),
    ("train.lr=nan", "train.lr must be a finite number, got nan"),
    ("model.rope_theta=inf", "model.rope_theta must be a finite number"),
    ("train.b1=-0.1", "train.b1 must be in [0, 1)"),
    ("train.b2=1", "train.b2 must be in [0, 1), got 1.0"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("train.grad_clip=0", "train.grad_clip must be > 0"),
    ("train.weight_decay=-1e-4", "train.weight_decay must be >= 0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1]"),
    ("model.norm_eps=0", "model.norm_eps must be in (0, 1)"),
    ("model.logit_softcap=-30", "model.logit_softcap must be >= 0 (0: no soft cap)"),
    ("model.query_pre_attn_scalar=-1", "model.query_pre_attn_scalar must be >= 0 (0: head_dim)"),
    ("model.sliding_window=-1", "model.sliding_window must be >= 0"),
    ("model.rope_local_theta=-1", "model.rope_local_theta must be >= 0 (0: model.rope_theta)"),
    ("data.num_threads=-1", "data.num_threads must be >= 0"),
    ("sample.temperature=-0.5", "sample.temperature must be >= 0"),
    ("sample.max_new_tokens=0", "sample.max_new_tokens must be >= 1"),
    ("export.checkpoint_step=-2", "export.checkpoint_step must be >= -1"),
    ("parallel.process_id=-5", "parallel.process_id must be >= -1"),
    ("objective.eps_min=0", "need 0 < objective.eps_min <= objective.eps_max <= 1"),
    ("objective.eps_min=0.5,objective.eps_max=0.4", "objective.eps_min <= objective.eps_max"),
    ("train.batch_size=0", "train.batch_size must be >= 1"),
    ("seed=-1", "seed must be in [0, 2**32)"),
    ("seed=4294967296", "seed must be in [0, 2**32)"),
    ("data.holdout=1", "data.holdout must be in [0, 1), got 1.0"),
    ("train.eval_every=-1", "train.eval_every must be >= 0 (0: never)"),
    ("eval.t_min=0", "eval.t_min must be in (0, 1)"),
    ("eval.noise_draws=0", "eval.noise_draws must be >= 1"),
    ("eval.batches=0", "eval.batches must be >= 1"),
])
def test_a_number_out_of_range_names_the_key_and_the_rule(item, expected):
  with pytest.raises(ConfigError) as e:
    override(Config(), item.split(","))
  assert expected in str(e.value)


@pytest.mark.parametrize("body, expected", [
    ("def get_config():\n  return {'model': 5}\n",
     "config section 'model' must be a dict of its keys (or a ModelConfig), got 5"),
    ("from bdlm_jax.config import Config\ndef get_config():\n  return Config(train=[1])\n",
     "config section 'train' must be a dict"),
])
def test_a_section_of_the_wrong_type_is_a_config_error(tmp_path, body, expected):
  path = tmp_path / "exp.py"
  path.write_text(body)
  with pytest.raises(ConfigError) as e:
    load_config(str(path))
  assert expected in str(e.value)


@pytest.mark.parametrize("body, expected", [
    ("def get_config():\n  return {'train': {'steps': undefined_name}}\n",
     "exp.py, line 2 raised NameError: name 'undefined_name' is not defined"),
    ("import no_such_module_here\n", "exp.py, line 1 raised ModuleNotFoundError"),
    ("def get_config(:\n  pass\n", "exp.py, line 1 raised SyntaxError"),
])
def test_a_config_file_that_fails_to_run_names_the_file_and_line(tmp_path, body, expected):
  path = tmp_path / "exp.py"
  path.write_text(body)
  with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")):
    load_config(str(path))


def test_a_retired_key_is_dropped_from_a_saved_config_and_refused_as_an_override():
  """parallel.tensor (a reserved axis, never used) is gone: checkpoints that wrote it still
  load; setting it is an unknown key."""
  saved = Config().to_dict()
  saved["parallel"]["tensor"] = 1
  assert Config.from_dict(saved) == Config()
  with pytest.raises(ConfigError, match="parallel.tensor"):
    override(Config(), ["parallel.tensor=2"])


CONFIG_FILES = sorted(
    p for p in os.listdir(os.path.join(os.path.dirname(__file__), "..", "configs"))
    if p.endswith(".py"))


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_file_loads_and_validates(name):
  load_config(os.path.join(os.path.dirname(__file__), "..", "configs", name))


@pytest.mark.parametrize("items,expected", [
    (["pretrain.objective=ar", "init_from=/x"], "both say where training starts"),
    (["pretrain.objective=arr"], r"pretrain.objective='arr' is not one of \['', 'bd3lm'"),
    (["pretrain.objective=ar", "objective.name=dflash"], "a drafter run starts from its frozen"),
    (["pretrain.objective=ar", "pretrain.steps=0"], "pretrain.steps"),
])
def test_a_first_stage_that_cannot_run_is_refused_naming_it(items, expected):
  with pytest.raises(ConfigError, match=expected):
    override(Config(), items)


def test_the_first_stage_is_the_run_with_its_objective_steps_and_lr():
  from bdlm_jax.configure import pretrain_stage
  cfg = load_config(os.path.join(REPO, "configs", "quickstart.py"))
  first = pretrain_stage(cfg)
  assert (first.objective.name, first.train.steps, first.train.lr) == (
      "ar", cfg.pretrain.steps, cfg.pretrain.lr)
  assert (first.model, first.data, first.seed) == (cfg.model, cfg.data, cfg.seed)
  assert first.pretrain.objective == "" and first.train.eval_every == cfg.pretrain.steps
