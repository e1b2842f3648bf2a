"""The paper's recipe configs against the seed's own recipe files (Turbo-dLLM 0.1.6,
`dllm_parallel/recipes/runs/*.yaml`, defaults from `training/run_spec.py`): every setting
the two share a name for. What ours does differently is listed in each config's docstring."""

import dataclasses
import pathlib

import pytest

from bdlm_jax.configure import load_config

yaml = pytest.importorskip("yaml")
recipes = pytest.importorskip("dllm_parallel.recipes")
run_spec = pytest.importorskip("dllm_parallel.training.run_spec")

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
PAIRS = {"diffusiongemma_26b_a4b_sft_256k.py": "diffusiongemma-26b-sft-256k.yaml",
         "qwen3_5_27b_fast_dllm_v2_256k.py": "qwen3-8-27b-fast-dllm-v2-256k.yaml"}


def _recipe(name: str) -> dict:
  recipe = yaml.safe_load((pathlib.Path(recipes.__file__).parent / "runs" / name).read_text())
  defaults = {f.name: f.default for f in dataclasses.fields(run_spec.OptimizerRunSpec)}
  recipe["optimizer"] = {**defaults, **recipe["optimizer"]}
  return recipe


def assert_the_seeds_optimizer(cfg, recipe: dict) -> None:
  """AdamW's settings and the run's seed, as the recipe file gives them."""
  t, opt = cfg.train, recipe["optimizer"]
  assert (t.lr, t.b1, t.b2, t.eps, t.weight_decay, t.grad_clip) == pytest.approx(
      (opt["lr"], opt["adam_beta1"], opt["adam_beta2"], opt["adam_eps"], opt["weight_decay"],
       opt["gradient_clip_norm"]))
  assert cfg.seed == recipe["launch"]["seed"]


@pytest.mark.parametrize("config, recipe_file", PAIRS.items())
def test_recipe_config_trains_as_the_seeds_recipe(config, recipe_file):
  cfg, recipe = load_config(str(CONFIGS / config)), _recipe(recipe_file)
  sched, train, obj = (recipe[k] for k in ("scheduler", "training", "objective"))
  t = cfg.train
  assert_the_seeds_optimizer(cfg, recipe)
  # One parameter group (every weight decayed); the seed's warm-up-then-cosine schedule
  assert t.decay_vectors and sched["type"] == "cosine" and t.schedule == "seed_cosine"
  assert (t.warmup_steps, t.steps, t.lr * t.min_lr_ratio) == pytest.approx(
      (sched["warmup_steps"], sched["decay_steps"], sched["min_lr"]))
  assert (t.batch_size, t.steps, t.grad_accum) == (
      train["batch_size"], train["steps"], train["gradient_accumulation_steps"])
  assert cfg.data.seq_len == recipe["model"]["seq_len"]
  o = cfg.objective
  assert (o.block_size, o.loss_weight) == (obj["block_size"], obj["loss_weighting"])
  if "noise_schedule_epsilon" in obj:  # fast_dllm_v2: t in [eps, 1], drawn independently
    assert (o.name, o.eps_min, o.eps_max, o.antithetic) == (
        "fast_dllm_v2", obj["noise_schedule_epsilon"], 1.0, False)
    assert (o.boundary_row, o.keep_mask_logit) == ("noisy", True)
    assert cfg.data.pack and not cfg.data.segment_ids  # one continuous packed stream
  else:
    assert (o.eps_min, o.eps_max, o.antithetic, o.self_condition_p,
            o.encoder_loss_weight) == (
        obj["sampling_epsilon_min"], obj["sampling_epsilon_max"], obj["antithetic_sampling"],
        obj["self_conditioning_probability"], obj["encoder_loss_weight"])
    assert not cfg.data.pack  # one conversation a row


DFLASH2_PAIRS = {"dflash2_muse_1m.py": "dflash2-muse-glimmer-30b-1m.yaml",
                 "dflash2_qwen3_8_27b_1m.py": "dflash2-qwen3-8-27b-1m.yaml"}


@pytest.mark.parametrize("config, recipe_file", DFLASH2_PAIRS.items())
def test_dflash2_config_trains_as_the_seeds_recipe(config, recipe_file):
  cfg, recipe = load_config(str(CONFIGS / config)), _recipe(recipe_file)
  train, obj, topo = (recipe[k] for k in ("training", "objective", "topology"))
  t = cfg.train
  assert_the_seeds_optimizer(cfg, recipe)
  # One parameter group; the seed's default schedule is constant with no warm-up
  assert "scheduler" not in recipe and run_spec.SchedulerRunSpec().type == "constant"
  assert t.decay_vectors and (t.warmup_steps, t.min_lr_ratio) == (0, 1.0)
  # CP and BP share one axis of max(CP, BP); the rest of the 8 GPUs are data-parallel, each
  # group one sequence of micro batch x accumulation
  ring = max(topo["context_parallel_size"], topo["block_parallel_size"])
  assert (cfg.parallel.seq, cfg.parallel.data) == (ring, 8 // ring)
  assert (t.batch_size, t.steps, t.grad_accum) == (
      train["batch_size"] * 8 // ring, train["steps"], train["gradient_accumulation_steps"])
  assert cfg.data.seq_len == recipe["model"]["seq_len"]
  assert cfg.model.param_dtype == {"bf16": "bfloat16"}[recipe["model"]["dtype"]]
  assert (cfg.model.remat == "none") == (not train["activation_checkpointing"])
  o = cfg.objective
  assert (o.name, o.block_size, o.max_anchors, o.anchors) == (
      "dflash", obj["block_size"], obj["max_anchors"], obj["anchor_sampling"])
  assert (o.dflash_loss, o.gamma, o.dpace_alpha, o.lk_loss, o.kl_scale, o.kl_decay,
          o.selector_loss_alpha) == (
      obj["dflash_loss"], obj["decay_gamma"], obj["dpace_alpha"], obj["lk_loss_type"],
      obj["kl_scale"], obj["kl_decay"], obj["selector_loss_alpha"])
  # The recipe's ids are canonical (Hugging Face's hidden_states[i]); ours are 0-based layer
  # outputs (hidden_states[i + 1]): the seed's own conversion of a served config's ids
  dflash_model = pytest.importorskip("dllm_parallel.core.models.backbones.dflash.model")
  ours = [int(i) for i in cfg.drafter.target_layers.split(",")]
  assert dflash_model.dflash_target_layer_ids(
      {"dflash_config": {"target_layer_ids": ours}}) == tuple(recipe["model"]["target_layer_ids"])
  assert max(ours) < cfg.model.n_layers
  assert cfg.drafter.features == recipe["data"]["target_feature_path"]
