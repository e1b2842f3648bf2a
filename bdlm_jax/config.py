"""Experiment configuration: one dataclass per concern, loaded from a Python file.

A config file exposes `get_config() -> Config`. Overrides use dotted names
(`objective.block_size=32`) and are parsed with the type of the field they set, so a
typo or a wrong type fails at load time with a message that lists what is valid.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import traceback
import typing
from typing import Any, Iterable

import numpy as np


class ConfigError(ValueError):
  """A config key, value or combination that cannot run."""


STRATEGIES = ("none", "cp_allgather", "cp_ring", "cp_ring_balanced", "bp", "csbp_allgather",
              "csbp_ring")
OBJECTIVES = ("bd3lm", "fast_dllm_v2", "ar", "dflash")
ANCHOR_SAMPLING = ("uniform", "strided")  # objective.anchors (dflash)
ATTENTION_IMPLS = ("xla", "pallas")
LAYER_TYPES = ("global", "local")
MLP_TYPES = ("dense", "moe")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen3), GeGLU (Gemma 3)
MOE_DISPATCHES = ("ragged_all_to_all", "all_gather")  # parallel.moe_dispatch
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full")
MODES = ("train", "eval", "sample", "export", "plan")
DATA_SOURCES = ("arithmetic", "text", "jsonl", "array_record")
DATA_FORMATS = ("text", "chat")
CHAT_TEMPLATES = ("plain", "chatml")  # defined in bdlm_jax/data/chat.py


@dataclasses.dataclass
class ModelConfig:
  vocab_size: int = 260  # 256 bytes + BOS, EOS, PAD, MASK for the byte tokenizer
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  qk_norm: bool = False  # Qwen3-style RMSNorm on q and k per head
  # Attention type of each layer as a repeating period, comma-separated "global" / "local"
  # (Gemma 3: "local,local,local,local,local,global"); the layers scan over one period.
  # Local layers see a sliding window of `sliding_window` positions (DESIGN.md section 11).
  layer_pattern: str = "global"
  sliding_window: int = 0  # W, needed (>= 1) when the pattern has a local layer
  rope_local_theta: float = 0.0  # RoPE base of local layers; 0: rope_theta
  # Mixture of experts (Qwen3-MoE form) in the MLPs when moe_experts > 0: top-k of a softmax
  # router, experts of width moe_d_ff (0: d_ff) run as grouped matmuls.
  moe_experts: int = 0  # E; 0: dense MLPs
  # MLP kind of each layer as a repeating period, comma-separated "dense" / "moe" (Qwen3-MoE's
  # decoder_sparse_step 2: "dense,moe"); empty: every layer "moe" if moe_experts, else "dense".
  mlp_pattern: str = ""
  moe_top_k: int = 2
  moe_d_ff: int = 0
  moe_norm_topk: bool = False  # renormalise the k weights to sum to 1 (norm_topk_prob)
  moe_aux_weight: float = 0.001  # load-balancing loss (Qwen3-MoE's router_aux_loss_coef)
  moe_z_weight: float = 0.0  # router z-loss
  # Drop (token, expert) pairs over an expert's capacity, ceil(factor * tokens * k / E) of
  # the tokens routed together (a device's rows, or an expert-parallel group's); the share
  # dropped is logged as moe_dropped. Off: every pair is computed.
  moe_drop_tokens: bool = False
  moe_capacity_factor: float = 1.25
  # Gemma 3's departures from Llama (all off for Llama and Qwen3):
  post_norms: bool = False  # an RMSNorm on the attention and MLP outputs, before each residual add
  scale_embeddings: bool = False  # input embeddings times sqrt(d_model); the tied head is not
  query_pre_attn_scalar: int = 0  # attention logits scaled by its ** -0.5; 0: head_dim
  mlp_activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
  logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # "full": a layer keeps only its input and the attention core's output + LSE for the
  # backward, and recomputes projections, norms and the MLP; "none" keeps everything.
  remat: str = "none"
  attention_impl: str = "xla"
  attention_chunk: int = 512  # keys per step of the flash-style loop
  # Rows of each sequence held on a device whose float32 logits exist at once in the loss,
  # [local sequences, chunk, vocab] (recomputed in the backward); 0: all rows at once.
  logits_chunk: int = 1024


@dataclasses.dataclass
class DataConfig:
  source: str = "arithmetic"  # embedded default: needs no download
  path: str = ""  # file or glob for text / jsonl / array_record sources
  text_field: str = "text"  # key of the text in JSONL / ArrayRecord (JSON) records
  tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
  # "chat": JSONL records {"messages": [{"role", "content"}, ...]} for SFT; the last assistant
  # message is the response, everything before it the (never corrupted) prompt.
  format: str = "text"
  chat_template: str = "plain"  # how messages render to text: "plain" or "chatml"
  seq_len: int = 128  # L
  shuffle: bool = True
  num_threads: int = 2  # grain read threads (2-core friendly)
  # The held-out split (evaluation). The embedded source draws it from another seed; file
  # sources read `eval_path` (same format) if set, else hold out the last `holdout` fraction
  # of their documents (rounded down), which training then never sees.
  eval_path: str = ""
  holdout: float = 0.01


@dataclasses.dataclass
class ObjectiveConfig:
  name: str = "bd3lm"
  block_size: int = 16  # B
  eps_min: float = 1e-3
  eps_max: float = 1.0
  loss_weight: str = "inv_t"  # or "unit"
  mask_token_id: int = 259
  # dflash (DESIGN.md section 10): up to `max_anchors` draft blocks [x_a, MASK x (B-1)] per
  # sequence, anchors drawn uniformly or strided over the supervised positions; draft slot
  # k >= 1 predicts x_{a+k} with weight exp(-(k-1)/gamma), by cross-entropy to the data
  # ("ce") or by KL divergence from the target's own next-token distribution ("kl").
  max_anchors: int = 8
  anchors: str = "uniform"
  gamma: float = 7.0
  draft_loss: str = "ce"

  @property
  def reserved_mask_id(self) -> int | None:
    """The id no data may hold: [MASK], for objectives that corrupt (None for `ar`)."""
    return None if self.name == "ar" else self.mask_token_id


@dataclasses.dataclass
class DrafterConfig:
  """objective=dflash: a small block-diffusion drafter over a frozen target, the model that
  `model.*` describes (DESIGN.md section 10). The drafter shares the target's embedding and
  LM head (so its width is the target's d_model); 0 widths take the target's."""
  target: str = ""  # the frozen target: a Hugging Face folder or a workdir of ours
  n_layers: int = 1
  n_heads: int = 0
  n_kv_heads: int = 0
  head_dim: int = 0
  d_ff: int = 0
  # Target layers (0-based) whose output hidden states, concatenated per position, are the
  # drafter's context; empty: `n_layers` of them spread over the target's depth.
  target_layers: str = ""
  # A folder of precomputed target features (experiments/dflash_features.py), for targets too
  # large to co-host: the step reads them from the batch and the target's layers are not
  # loaded (only the embedding, final norm and LM head the drafter shares). Empty: the
  # target runs inside the step.
  features: str = ""


@dataclasses.dataclass
class ParallelConfig:
  strategy: str = "none"
  data: int = 1
  fsdp: int = 1
  seq: int = 1
  tensor: int = 1  # reserved axis; only 1 is supported today
  # dtype of the travelling dK/dV (ring accumulators, all-gather's reduce-scatter); K/V
  # themselves travel in model.compute_dtype.
  kv_grad_dtype: str = "float32"
  # Expert parallelism: mesh axes (comma-separated, from data, fsdp, seq) whose devices split
  # the experts of each MoE layer; tokens travel to their experts' devices and back by
  # moe_dispatch: ragged_all_to_all (exact-size messages; GPU/TPU) or all_gather (gather every
  # token of the group, psum_scatter the outputs back; runs everywhere). Empty: every device
  # holds every expert and routes its own rows.
  expert_axes: str = ""
  moe_dispatch: str = "ragged_all_to_all"
  # Multi-host: left empty, jax.distributed.initialize reads the environment (SLURM, ...).
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  distributed: bool = False


@dataclasses.dataclass
class TrainConfig:
  steps: int = 200
  batch_size: int = 8  # global sequences per optimiser step
  grad_accum: int = 1
  lr: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  log_every: int = 10
  ckpt_every: int = 100
  max_to_keep: int = 3
  async_checkpoint: bool = True
  peak_tflops: float = 0.0  # per device, for the MFU estimate; 0 guesses from the backend
  # Steps with a non-finite loss, gradient or update are skipped; this many in a row stop the run.
  max_bad_steps: int = 3
  eval_every: int = 0  # steps between held-out evaluations (and one at the end); 0: never


@dataclasses.dataclass
class SampleConfig:
  """mode=sample: block-wise semi-autoregressive generation from a trained checkpoint."""
  prompt: str = ""
  prompt_file: str = ""
  max_new_tokens: int = 64
  steps_per_block: int = 0  # 0: one token unmasked per step (block_size steps)
  strategy: str = "confidence"  # or "first_hitting"
  temperature: float = 0.0  # 0: greedy
  use_cache: bool = True  # KV cache of the clean blocks before the current one
  checkpoint_step: int = -1  # -1: latest


@dataclasses.dataclass
class EvalConfig:
  """Held-out evaluation (mode=eval, train.eval_every): NELBO / NLL per token, arithmetic."""
  # Held-out batches, the same at every eval, of train.batch_size / train.grad_accum sequences.
  batches: int = 4
  noise_draws: int = 4  # fixed noise draws averaged per batch (diffusion objectives)
  t_min: float = 1e-3  # bd3lm's NELBO integrates t over [t_min, 1] with weight 1/t
  prompts: int = 64  # held-out arithmetic prompts (embedded data only; 0: skip)
  checkpoint_step: int = -1  # mode=eval: -1: latest


@dataclasses.dataclass
class ExportConfig:
  """mode=export: write a Hugging Face folder from a checkpoint."""
  out_dir: str = ""
  checkpoint_step: int = -1  # -1: latest
  dtype: str = "float32"


@dataclasses.dataclass
class PlanConfig:
  """mode=plan: compile (never run) the train step under every strategy and compare."""
  device_memory_gb: float = 0.0  # per device; 0: what the device reports, else 141 (an H200)


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  drafter: DrafterConfig = dataclasses.field(default_factory=DrafterConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
  plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
  seed: int = 0
  mode: str = "train"  # train | eval | sample | export | plan
  init_from: str = ""  # a Hugging Face folder whose weights initialise training (conversion)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "Config":
    return _from_dict(cls, d, prefix="")


def _from_dict(cls, d: dict, prefix: str):
  if not isinstance(d, dict):
    where = f"config section '{prefix[:-1]}'" if prefix else "a config"
    raise ConfigError(f"{where} must be a dict of its keys (or a {cls.__name__}), got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in d.items():
    if name not in fields:
      raise ConfigError(f"unknown config key '{prefix}{name}'; valid keys: {sorted(fields)}")
    if dataclasses.is_dataclass(hints[name]):
      kwargs[name] = _from_dict(hints[name], value, prefix=f"{prefix}{name}.")
    else:
      kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}")
  return cls(**kwargs)


def all_keys(cfg: Any = None, prefix: str = "") -> list[str]:
  """Every dotted key a config accepts, for error messages and `--set`."""
  cfg = Config() if cfg is None else cfg
  keys = []
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      keys += all_keys(value, prefix=f"{prefix}{f.name}.")
    else:
      keys.append(prefix + f.name)
  return keys


def _coerce(value: Any, typ: type, key: str) -> Any:
  """Parses/validates `value` for a field annotated `typ`; strings come from the CLI."""
  if typ is bool:
    if isinstance(value, str):
      low = value.strip().lower()
      if low in ("1", "true", "yes", "on"):
        return True
      if low in ("0", "false", "no", "off"):
        return False
    elif isinstance(value, (bool, int)) and value in (0, 1):
      return bool(value)
  elif typ is int:
    if isinstance(value, str):  # "1_000", "0x10", "1e3"; not "2.5" or "True"
      try:
        value = ast.literal_eval(value.strip().replace("_", ""))
      except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
  elif typ is float:
    if isinstance(value, str):
      try:
        return float(value)
      except ValueError:
        pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif typ is str:
    if isinstance(value, str):
      return value
  else:
    raise ConfigError(f"config key '{key}' has an unsupported type {typ}")
  raise ConfigError(f"config key '{key}' expects {typ.__name__}, got {value!r}")


def override(cfg: Config, overrides: Iterable[str] = ()) -> Config:
  """Returns a copy of `cfg` with `a.b=c` overrides applied and validated."""
  cfg = Config.from_dict(cfg.to_dict())
  valid = all_keys()
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override '{item}' must look like key=value, e.g. train.steps=10")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key not in valid:
      raise ConfigError(f"unknown config key '{key}'; valid keys: {', '.join(valid)}")
    *path, leaf = key.split(".")
    node = cfg
    for p in path:
      node = getattr(node, p)
    hint = typing.get_type_hints(type(node))[leaf]
    setattr(node, leaf, _coerce(raw, hint, key))
  validate(cfg)
  return cfg


def load_config(path: str, overrides: Iterable[str] = ()) -> Config:
  """Loads `get_config()` from a Python file, then applies `overrides`."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location("_bdlm_config", path)
  module = importlib.util.module_from_spec(spec)
  with _config_file_errors(path):
    spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} does not define get_config()")
  with _config_file_errors(path):
    cfg = module.get_config()
  if isinstance(cfg, dict):
    cfg = Config.from_dict(cfg)
  if not isinstance(cfg, Config):
    raise ConfigError(f"get_config() in {path} must return a bdlm_jax Config, got {type(cfg)}")
  return override(cfg, overrides)


@contextlib.contextmanager
def _config_file_errors(path: str):
  """A config file that fails to run (a typo, a bad import) is a ConfigError naming the file
  and line, so the CLI reports it in one line instead of a traceback."""
  try:
    yield
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, SyntaxError):
      line, text = e.lineno, e.msg
    else:
      frames = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                if os.path.abspath(f.filename) == os.path.abspath(path)]
      line, text = (frames[-1] if frames else None), str(e)
    where = f"{path}, line {line}" if line else path
    raise ConfigError(f"config file {where} raised {type(e).__name__}: {text}") from e


_ABOVE_0 = ("> 0", lambda x: x > 0)
_AT_LEAST_0 = (">= 0", lambda x: x >= 0)
_STEP = (">= -1 (-1: the latest)", lambda x: x >= -1)
# Numeric keys with a range beyond the ">= 1" counts listed in `validate`: key -> (rule,
# test). Every float must also be finite.
_RANGES = {
    "model.rope_theta": _ABOVE_0,
    "model.rope_local_theta": (">= 0 (0: model.rope_theta)", lambda x: x >= 0),
    "model.sliding_window": (">= 0 (0: no local layers)", lambda x: x >= 0),
    "model.moe_experts": (">= 0 (0: dense MLPs)", lambda x: x >= 0),
    "model.moe_d_ff": (">= 0 (0: model.d_ff)", lambda x: x >= 0),
    "model.moe_aux_weight": _AT_LEAST_0,
    "model.moe_z_weight": _AT_LEAST_0,
    "model.moe_capacity_factor": _ABOVE_0,
    "model.norm_eps": ("in (0, 1)", lambda x: 0 < x < 1),
    "model.query_pre_attn_scalar": (">= 0 (0: head_dim)", lambda x: x >= 0),
    "model.logit_softcap": (">= 0 (0: no soft cap)", lambda x: x >= 0),
    "objective.gamma": _ABOVE_0,
    "drafter.n_heads": (">= 0 (0: the target's)", lambda x: x >= 0),
    "drafter.n_kv_heads": (">= 0 (0: the target's)", lambda x: x >= 0),
    "drafter.head_dim": (">= 0 (0: the target's)", lambda x: x >= 0),
    "drafter.d_ff": (">= 0 (0: the target's)", lambda x: x >= 0),
    "data.num_threads": _AT_LEAST_0,
    "train.lr": _ABOVE_0,
    "train.warmup_steps": _AT_LEAST_0,
    "train.min_lr_ratio": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "train.weight_decay": _AT_LEAST_0,
    "train.b1": ("in [0, 1)", lambda x: 0 <= x < 1),
    "train.b2": ("in [0, 1)", lambda x: 0 <= x < 1),
    "train.grad_clip": ("> 0 (the global-norm bound: 0 would zero every update)",
                        lambda x: x > 0),
    "train.peak_tflops": (">= 0 (0: guessed from the backend)", lambda x: x >= 0),
    "parallel.num_processes": (">= 0 (0: from the environment)", lambda x: x >= 0),
    "parallel.process_id": (">= -1 (-1: from the environment)", lambda x: x >= -1),
    "sample.steps_per_block": (">= 0 (0: one token per step)", lambda x: x >= 0),
    "sample.temperature": (">= 0 (0: greedy)", lambda x: x >= 0),
    "sample.checkpoint_step": _STEP,
    "data.holdout": ("in [0, 1)", lambda x: 0 <= x < 1),
    "train.eval_every": (">= 0 (0: never)", lambda x: x >= 0),
    "eval.t_min": ("in (0, 1)", lambda x: 0 < x < 1),
    "eval.prompts": (">= 0 (0: no arithmetic eval)", lambda x: x >= 0),
    "eval.checkpoint_step": _STEP,
    "seed": ("in [0, 2**32) (Grain's shuffle seed range)", lambda x: 0 <= x < 2**32),
    "export.checkpoint_step": _STEP,
}


def _choice(key: str, value: str, allowed: Iterable[str]) -> None:
  if value not in allowed:
    raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")


def validate(cfg: Config) -> None:
  """Checks every constraint that can be checked without devices or data."""
  m, d, o, p, t = cfg.model, cfg.data, cfg.objective, cfg.parallel, cfg.train
  _choice("parallel.strategy", p.strategy, STRATEGIES)
  _choice("objective.name", o.name, OBJECTIVES)
  _choice("model.attention_impl", m.attention_impl, ATTENTION_IMPLS)
  _choice("model.param_dtype", m.param_dtype, DTYPES)
  _choice("model.compute_dtype", m.compute_dtype, DTYPES)
  _choice("model.remat", m.remat, REMAT)
  _choice("model.mlp_activation", m.mlp_activation, MLP_ACTIVATIONS)
  _choice("objective.loss_weight", o.loss_weight, ("inv_t", "unit"))
  _choice("objective.anchors", o.anchors, ANCHOR_SAMPLING)
  _choice("objective.draft_loss", o.draft_loss, ("ce", "kl"))
  _choice("data.source", d.source, DATA_SOURCES)
  _choice("data.format", d.format, DATA_FORMATS)
  _choice("data.chat_template", d.chat_template, CHAT_TEMPLATES)
  if d.format == "chat" and d.source != "jsonl":
    raise ConfigError(f"data.format='chat' reads JSONL records with 'messages'; set "
                      f"data.source=jsonl (got {d.source!r})")
  _choice("mode", cfg.mode, MODES)
  _choice("sample.strategy", cfg.sample.strategy, ("confidence", "first_hitting"))
  _choice("export.dtype", cfg.export.dtype, DTYPES)
  _choice("parallel.kv_grad_dtype", p.kv_grad_dtype, DTYPES)
  positive = {
      "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.n_layers": m.n_layers,
      "model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads, "model.head_dim": m.head_dim,
      "model.d_ff": m.d_ff, "model.attention_chunk": m.attention_chunk, "data.seq_len": d.seq_len,
      "objective.block_size": o.block_size, "parallel.data": p.data, "parallel.fsdp": p.fsdp,
      "parallel.seq": p.seq, "parallel.tensor": p.tensor, "train.steps": t.steps,
      "train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
      "train.log_every": t.log_every, "train.ckpt_every": t.ckpt_every,
      "train.max_to_keep": t.max_to_keep, "train.max_bad_steps": t.max_bad_steps,
      "sample.max_new_tokens": cfg.sample.max_new_tokens, "eval.batches": cfg.eval.batches,
      "eval.noise_draws": cfg.eval.noise_draws, "objective.max_anchors": o.max_anchors,
      "drafter.n_layers": cfg.drafter.n_layers,
  }
  for key, value in positive.items():
    if value < 1:
      raise ConfigError(f"{key} must be >= 1, got {value}")
  for key in all_keys(cfg):
    value = functools.reduce(getattr, key.split("."), cfg)
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes any comparison
      raise ConfigError(f"{key} must be a finite number, got {value}")
  for key, (rule, holds) in _RANGES.items():
    value = functools.reduce(getattr, key.split("."), cfg)
    if not holds(value):
      raise ConfigError(f"{key} must be {rule}, got {value}")
  if cfg.plan.device_memory_gb < 0:
    raise ConfigError(f"plan.device_memory_gb must be >= 0 (0: what the device reports), got "
                      f"{cfg.plan.device_memory_gb}")
  if m.logits_chunk < 0:
    raise ConfigError(f"model.logits_chunk must be >= 0 (0: no chunking), got {m.logits_chunk}")
  _check_layer_pattern(m)
  if m.moe_experts and not 1 <= m.moe_top_k <= m.moe_experts:
    raise ConfigError(f"model.moe_top_k={m.moe_top_k} must lie in [1, model.moe_experts="
                      f"{m.moe_experts}]: each token picks k of the E experts")
  _check_expert_parallel(m, p)
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(
        f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={m.n_kv_heads}")
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE")
  if not 0 <= o.mask_token_id < m.vocab_size:
    raise ConfigError(
        f"objective.mask_token_id={o.mask_token_id} must lie in [0, model.vocab_size={m.vocab_size})")
  if not 0.0 < o.eps_min <= o.eps_max <= 1.0:
    raise ConfigError(
        f"need 0 < objective.eps_min <= objective.eps_max <= 1, got {o.eps_min}, {o.eps_max}")
  if o.name == "dflash":  # draft blocks start at anchors, anywhere: no multiple needed
    _check_drafter(cfg)
  elif o.name != "ar" and d.seq_len % o.block_size:
    raise ConfigError(
        f"data.seq_len={d.seq_len} is not a multiple of objective.block_size={o.block_size}; "
        f"choose a block size that divides the sequence length")
  if p.tensor != 1:
    raise ConfigError("parallel.tensor > 1 is not supported yet; set parallel.tensor=1")
  if p.strategy == "none" and p.seq != 1:
    raise ConfigError(
        f"parallel.strategy='none' needs parallel.seq=1 (got {p.seq}); pick a sequence strategy "
        f"such as csbp_ring to split sequences")
  batch_ways = p.data * p.fsdp
  if t.batch_size % (batch_ways * t.grad_accum):
    raise ConfigError(
        f"train.batch_size={t.batch_size} must be divisible by parallel.data*parallel.fsdp"
        f"*train.grad_accum={batch_ways * t.grad_accum}")
  if d.source != "arithmetic" and not d.path:
    raise ConfigError(f"data.source={d.source!r} needs data.path")
  if o.name == "ar" and p.strategy in ("bp", "csbp_ring", "csbp_allgather"):
    raise ConfigError(
        f"parallel.strategy={p.strategy!r} splits corrupted blocks and cannot run the 'ar' "
        f"objective, which has no corrupted stream; use none, cp_ring or cp_allgather")
  # The layout (block count vs ranks, divisibility) fails here, not at the first batch.
  from bdlm_jax.parallel.strategies import plan_for  # late: strategies imports this module
  plan_for(cfg)


def layer_period(m: ModelConfig) -> tuple[str, ...]:
  """The attention types of one period of `m.layer_pattern`."""
  return tuple(t.strip() for t in m.layer_pattern.split(","))


def layer_types(m: ModelConfig) -> tuple[str, ...]:
  """The attention type of every layer: `m.layer_pattern` repeated over `m.n_layers`."""
  period = layer_period(m)
  return tuple(period[i % len(period)] for i in range(m.n_layers))


def mlp_period(m: ModelConfig) -> tuple[str, ...]:
  """The MLP kinds of one period of `m.mlp_pattern` (default: all MoE with experts)."""
  if m.mlp_pattern.strip():
    return tuple(t.strip() for t in m.mlp_pattern.split(","))
  return ("moe",) if m.moe_experts else ("dense",)


def mlp_types(m: ModelConfig) -> tuple[str, ...]:
  """The MLP kind, dense or moe, of every layer."""
  period = mlp_period(m)
  return tuple(period[i % len(period)] for i in range(m.n_layers))


def expert_axes(p: "ParallelConfig") -> tuple[str, ...]:
  """`parallel.expert_axes` as a tuple of mesh axis names."""
  return tuple(a.strip() for a in p.expert_axes.split(",") if a.strip())


def _check_expert_parallel(m: ModelConfig, p: "ParallelConfig") -> None:
  _choice("parallel.moe_dispatch", p.moe_dispatch, MOE_DISPATCHES)
  axes = expert_axes(p)
  if not axes:
    return
  for axis in axes:
    _choice("parallel.expert_axes entry", axis, ("data", "fsdp", "seq"))
  if len(set(axes)) != len(axes):
    raise ConfigError(f"parallel.expert_axes={p.expert_axes!r} names an axis twice")
  if not m.moe_experts:
    raise ConfigError(f"parallel.expert_axes={p.expert_axes!r} splits experts, but "
                      f"model.moe_experts=0 (dense MLPs)")
  ways = math.prod(getattr(p, a) for a in axes)
  if m.moe_experts % ways:
    raise ConfigError(f"model.moe_experts={m.moe_experts} does not divide over "
                      f"parallel.expert_axes={p.expert_axes!r} ({ways} devices)")


def target_layer_ids(cfg: Config) -> tuple[int, ...]:
  """The target layers whose outputs feed the drafter: `drafter.target_layers`, or up to
  `drafter.n_layers` distinct ids spread from layer 1 to layer n-3 of the target (DFlash's
  choice: neither the first layer nor the last two), clipped to the target's depth."""
  text = cfg.drafter.target_layers.strip()
  if text:
    try:
      return tuple(int(t) for t in text.split(","))
    except ValueError:
      raise ConfigError(f"drafter.target_layers={text!r} must be comma-separated integers")
  n = cfg.model.n_layers
  lo, hi = min(1, n - 1), max(min(1, n - 1), n - 3)
  return tuple(int(i) for i in np.unique(np.round(np.linspace(lo, hi, cfg.drafter.n_layers))))


def target_depth(cfg: Config) -> int:
  """Target layers a drafter's step runs: up to its last chosen layer, all of them for a KL
  loss (which reads the target's output), none with precomputed features."""
  if cfg.drafter.features:
    return 0
  if cfg.objective.draft_loss == "kl":
    return cfg.model.n_layers
  return max(target_layer_ids(cfg)) + 1


def drafter_model(cfg: Config) -> ModelConfig:
  """The drafter's layers as a ModelConfig: Qwen3-style (q/k norm, SwiGLU, global attention),
  the target's width, dtypes and attention settings, `drafter.*` for the rest."""
  m, d = cfg.model, cfg.drafter
  return ModelConfig(
      vocab_size=m.vocab_size, d_model=m.d_model, n_layers=d.n_layers,
      n_heads=d.n_heads or m.n_heads, n_kv_heads=d.n_kv_heads or m.n_kv_heads,
      head_dim=d.head_dim or m.head_dim, d_ff=d.d_ff or m.d_ff, rope_theta=m.rope_theta,
      qk_norm=True, norm_eps=m.norm_eps, param_dtype=m.param_dtype,
      compute_dtype=m.compute_dtype, remat=m.remat, attention_impl=m.attention_impl,
      attention_chunk=m.attention_chunk, logits_chunk=m.logits_chunk)


def _check_drafter(cfg: Config) -> None:
  m, o, d = cfg.model, cfg.objective, cfg.drafter
  if cfg.data.seq_len < o.block_size:
    raise ConfigError(f"data.seq_len={cfg.data.seq_len} is shorter than one draft block "
                      f"(objective.block_size={o.block_size})")
  if o.block_size < 2:
    raise ConfigError(f"objective.block_size={o.block_size}: a draft block needs its anchor "
                      f"and at least one slot to predict (>= 2)")
  ids = target_layer_ids(cfg)
  bad = [i for i in ids if not 0 <= i < m.n_layers]
  if bad:
    raise ConfigError(f"drafter.target_layers {bad} lie outside the target's layers "
                      f"[0, model.n_layers={m.n_layers})")
  if len(set(ids)) != len(ids):
    raise ConfigError(f"drafter.target_layers={d.target_layers!r} names a layer twice")
  if set(layer_types(m)) != {"global"} or m.moe_experts:
    raise ConfigError("objective=dflash takes a dense, all-global target for now "
                      "(model.layer_pattern='global', model.moe_experts=0)")
  if d.features and o.draft_loss == "kl":
    raise ConfigError(f"objective.draft_loss='kl' needs the target's final hidden states, "
                      f"which drafter.features={d.features!r} does not hold; use "
                      f"draft_loss='ce' or co-host the target (drafter.features='')")
  if d.features and cfg.train.eval_every:
    raise ConfigError(f"drafter.features={d.features!r} holds training sequences only: "
                      f"held-out evaluation needs the target, so set train.eval_every=0")
  dm = drafter_model(cfg)
  if dm.n_heads % dm.n_kv_heads or dm.head_dim % 2:
    raise ConfigError(f"the drafter's heads ({dm.n_heads} query, {dm.n_kv_heads} key/value, "
                      f"head_dim {dm.head_dim}) need query heads a multiple of key/value heads "
                      f"and an even head_dim")


def _check_layer_pattern(m: ModelConfig) -> None:
  period = layer_period(m)
  for t in period:
    if t not in LAYER_TYPES:
      raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has the layer type {t!r}; "
                        f"valid types: {list(LAYER_TYPES)}, comma-separated")
  if "local" in period and m.sliding_window < 1:
    raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has local layers, whose "
                      f"model.sliding_window must be >= 1 position; got {m.sliding_window}")
  for t in mlp_period(m):
    if t not in MLP_TYPES:
      raise ConfigError(f"model.mlp_pattern={m.mlp_pattern!r} has the MLP type {t!r}; "
                        f"valid types: {list(MLP_TYPES)}, comma-separated")
  kinds = mlp_types(m)
  if "moe" in kinds and not m.moe_experts:
    raise ConfigError(f"model.mlp_pattern={m.mlp_pattern!r} has MoE layers, but "
                      f"model.moe_experts=0")
  if m.moe_experts and "moe" not in kinds:
    raise ConfigError(f"model.moe_experts={m.moe_experts}, but model.mlp_pattern="
                      f"{m.mlp_pattern!r} gives none of the {m.n_layers} layers an MoE")


def replace(cfg: Config, **sections: dict) -> Config:
  """Functional update by section: replace(cfg, model=dict(n_layers=4))."""
  d = cfg.to_dict()
  for section, values in sections.items():
    if dataclasses.is_dataclass(values):
      values = dataclasses.asdict(values)
    if isinstance(values, dict) and isinstance(d.get(section), dict):
      d[section].update(values)
    else:
      d[section] = values
  out = Config.from_dict(d)
  validate(out)
  return out


__all__ = ["Config", "ConfigError", "ModelConfig", "DataConfig", "ObjectiveConfig", "DrafterConfig",
           "ParallelConfig", "TrainConfig", "SampleConfig", "EvalConfig", "ExportConfig",
           "PlanConfig", "load_config", "layer_period", "layer_types",
           "override", "validate", "all_keys",
           "replace"]
