"""Experiment configuration: one dataclass per concern, loaded from a Python file.

A config file exposes `get_config() -> Config`. Overrides use dotted names
(`objective.block_size=32`) and are parsed with the type of the field they set, so a
typo or a wrong type fails at load time with a message that lists what is valid. Each
section checks its own fields (`validate`); rules that join sections live with the part
that owns them and run when a config is loaded (`bdlm_jax.configure`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import math
import typing
import warnings
from typing import Any, ClassVar, Iterable

from bdlm_jax.errors import ConfigError


ANCHOR_SAMPLING = ("uniform", "strided", "locality")  # objective.anchors (dflash)
DFLASH_LOSSES = ("", "dflash", "dpace", "dpace-cumulative-confidence-only",
                 "dpace-continuation-value-only")  # objective.dflash_loss
ATTENTION_IMPLS = ("xla", "pallas", "splash")
LAYER_TYPES = ("global", "local", "gdn")  # gdn: Gated DeltaNet (docs/gdn.md)
MLP_TYPES = ("dense", "moe")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen3), GeGLU (Gemma 3)
MOE_DISPATCHES = ("ragged_all_to_all", "all_gather")  # parallel.moe_dispatch
DTYPES = ("float32", "bfloat16")
DRAFT_TRANSPORTS = ("auto", "kv", "query", "seed")  # parallel.draft_transport
REMAT = ("none", "full", "offload", "offload_input", "offload_period")
MODES = ("train", "eval", "sample", "export", "plan", "prepare")
# "tokens": a folder of token ids written by mode=prepare (bdlm_jax/data/prepare.py).
# "parquet": Parquet files; "hf": a Hugging Face `datasets` folder (save_to_disk) or hub name.
DATA_SOURCES = ("arithmetic", "text", "jsonl", "array_record", "tokens", "parquet", "hf")
RECORD_SOURCES = ("jsonl", "parquet", "hf")  # rows are records: data.format=chat reads them
DATA_FORMATS = ("text", "chat")
SUPERVISE = ("assistant", "last", "all")  # data.supervise, in bdlm_jax/data/chat.py
CHAT_TEMPLATES = ("plain", "chatml", "tokenizer")  # in bdlm_jax/data/chat.py


class OneOf(tuple):
  """A rule: the value is one of these names."""

  def check(self, key: str, value) -> None:
    if value not in self:
      raise ConfigError(f"{key}={value!r} is not one of {list(self)}")


class Holds(typing.NamedTuple):
  """A rule: `test(value)` holds, described as `text` in the error."""
  text: str
  test: typing.Callable[[Any], bool]

  def check(self, key: str, value) -> None:
    if not self.test(value):
      raise ConfigError(f"{key} must be {self.text}, got {value}")


AT_LEAST_1 = Holds(">= 1", lambda x: x >= 1)
AT_LEAST_0 = Holds(">= 0", lambda x: x >= 0)
ABOVE_0 = Holds("> 0", lambda x: x > 0)
STEP = Holds(">= -1 (-1: the latest)", lambda x: x >= -1)


class Section:
  """A config section: checks its own fields against its `RULES` (field -> rule), then the
  rules that join several of its fields (`check`). Every float must be finite."""
  RULES: ClassVar[dict] = {}

  def validate(self, prefix: str = "") -> None:
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, Section):
        value.validate(f"{prefix}{f.name}.")
        continue
      if isinstance(value, float) and not math.isfinite(value):  # NaN passes any comparison
        raise ConfigError(f"{prefix}{f.name} must be a finite number, got {value}")
      if f.name in self.RULES:
        self.RULES[f.name].check(prefix + f.name, value)
    self.check()

  def check(self) -> None:
    """Rules over several fields of this section."""


def comma_list(text: str) -> tuple[str, ...]:
  """'a, b,c' -> ('a', 'b', 'c'); empty entries dropped."""
  return tuple(t.strip() for t in text.split(",") if t.strip())



@dataclasses.dataclass
class ModelConfig(Section):
  vocab_size: int = 260  # 256 bytes + BOS, EOS, PAD, MASK for the byte tokenizer
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  qk_norm: bool = False  # Qwen3-style RMSNorm on q and k per head
  qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2, Qwen2.5)
  # Attention type of each layer as a repeating period, comma-separated "global" / "local"
  # (Gemma 3: "local,local,local,local,local,global"); the layers scan over one period.
  # Local layers see a sliding window of `sliding_window` positions (docs/local_and_moe.md).
  layer_pattern: str = "global"
  sliding_window: int = 0  # W, needed (>= 1) when the pattern has a local layer
  rope_local_theta: float = 0.0  # RoPE base of local layers; 0: rope_theta
  # RoPE scaling as a JSON object of transformers' rope_parameters keys (models/rope.py;
  # docs/conversion_sft.md), e.g. '{"rope_type": "yarn", "factor": 4,
  # "original_max_position_embeddings": 32768}'; "": plain RoPE. Local layers: their own, "":
  # rope_scaling's.
  rope_scaling: str = ""
  rope_local_scaling: str = ""
  # Gated DeltaNet layers (kind "gdn", docs/gdn.md): key and value heads and their dims (0:
  # n_heads, head_dim) and the causal conv's kernel. Qwen3.5 / Qwen3-Next's attention layers
  # gate their output (q_proj gives [q | gate] per head: attention_gate) and rotate only the
  # first partial_rotary_factor of the head dim, frequencies over that part.
  gdn_key_heads: int = 0
  gdn_value_heads: int = 0
  gdn_key_dim: int = 0
  gdn_value_dim: int = 0
  gdn_conv: int = 4
  attention_gate: bool = False
  partial_rotary_factor: float = 1.0
  # Mixture of experts (Qwen3-MoE form) in the MLPs when moe_experts > 0: top-k of a softmax
  # router, experts of width moe_d_ff (0: d_ff) run as grouped matmuls.
  moe_experts: int = 0  # E; 0: dense MLPs
  # MLP kind of each layer as a repeating period, comma-separated "dense" / "moe" (Qwen3-MoE's
  # decoder_sparse_step 2: "dense,moe"); empty: every layer "moe" if moe_experts, else "dense".
  mlp_pattern: str = ""
  moe_top_k: int = 2
  moe_d_ff: int = 0
  moe_norm_topk: bool = False  # renormalise the k weights to sum to 1 (norm_topk_prob)
  # A shared SwiGLU expert of this width beside the routed ones, its output times
  # sigmoid(x @ w) (Qwen3.5-MoE, Qwen3-Next's shared_expert); 0: none.
  moe_shared_d_ff: int = 0
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
  # The head's logits times this before the soft cap (a verifier's `output_multiplier` in its
  # config.json, e.g. Muse's 0.19612): cap * tanh(m * logits / cap), or m * logits.
  output_multiplier: float = 1.0
  # Gemma 4's departures (docs/gemma4.md), all off elsewhere. Global layers with their own
  # head dim and K/V heads (0: head_dim, n_kv_heads), their keys and values from one
  # projection (attention_k_eq_v), and RoPE on only the first `global_partial_rotary_factor`
  # of their frequency pairs, each pair's frequency still over the whole head dim (HF's
  # "proportional" RoPE). The last layer is global whatever the pattern says
  # (last_layer_global). Values get an RMSNorm without weight (v_norm).
  global_head_dim: int = 0
  global_n_kv_heads: int = 0
  attention_k_eq_v: bool = False
  global_partial_rotary_factor: float = 1.0
  last_layer_global: bool = False
  v_norm: bool = False
  # Every MoE layer runs a dense MLP (d_ff) beside its experts, each output normed, their
  # sum normed by post_mlp_norm; the experts read their own norm of the residual.
  moe_beside_dense: bool = False
  # Gemma 4's router: it reads the residual through an RMSNorm without weight, times a
  # learned scale and d_model ** -0.5; a learned per-expert scale multiplies the k weights.
  moe_router_norm: bool = False
  layer_scalar: bool = False  # each layer's output times a fixed per-layer scalar
  # DiffusionGemma's self-conditioning module: a canvas's input embeddings plus a gated MLP
  # (d_ff) of the soft embeddings of the previous denoising step's logits.
  self_conditioning: bool = False
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # "full": a layer keeps only its input and the attention core's output + LSE for the
  # backward, and recomputes projections, norms and the MLP; "offload": the same, kept in
  # host memory; "offload_input": only the layer input, in host memory, the backward
  # re-running the whole layer, attention and its K/V transport included; "offload_period":
  # only each scan step's input (`scan_period` layers), in host memory, the backward re-running
  # the step's forward and then its layers as under "full"; "none" keeps everything.
  remat: str = "none"
  # Layers per step of the layer scan: a multiple of the patterns' period (the lcm of
  # `layer_pattern`'s and `mlp_pattern`'s lengths); 0: that period.
  scan_period: int = 0
  # A layer's row-wise work (norms, q/k/v/o projections, RoPE, MLP or experts) in this many
  # chunks of each device's rows (the last one shorter if need be), each rematerialised: no
  # [rows, d_ff] intermediate exists whole. 1: all rows at once.
  row_chunks: int = 1
  attention_impl: str = "xla"
  attention_chunk: int = 512  # queries and keys per tile of the flash-style loop (xla)
  # Rows of each sequence held on a device whose float32 logits exist at once in the loss,
  # [local sequences, chunk, vocab] (recomputed in the backward); 0: all rows at once.
  logits_chunk: int = 1024

  RULES = dict(
      vocab_size=AT_LEAST_1, d_model=AT_LEAST_1, n_layers=AT_LEAST_1, n_heads=AT_LEAST_1,
      n_kv_heads=AT_LEAST_1, head_dim=AT_LEAST_1, d_ff=AT_LEAST_1, attention_chunk=AT_LEAST_1,
      rope_theta=ABOVE_0,
      rope_local_theta=Holds(">= 0 (0: model.rope_theta)", lambda x: x >= 0),
      sliding_window=Holds(">= 0 (0: no local layers)", lambda x: x >= 0),
      moe_experts=Holds(">= 0 (0: dense MLPs)", lambda x: x >= 0),
      moe_d_ff=Holds(">= 0 (0: model.d_ff)", lambda x: x >= 0),
      moe_shared_d_ff=Holds(">= 0 (0: no shared expert)", lambda x: x >= 0),
      moe_aux_weight=AT_LEAST_0, moe_z_weight=AT_LEAST_0, moe_capacity_factor=ABOVE_0,
      norm_eps=Holds("in (0, 1)", lambda x: 0 < x < 1),
      query_pre_attn_scalar=Holds(">= 0 (0: head_dim)", lambda x: x >= 0),
      logit_softcap=Holds(">= 0 (0: no soft cap)", lambda x: x >= 0),
      output_multiplier=ABOVE_0,
      logits_chunk=Holds(">= 0 (0: no chunking)", lambda x: x >= 0),
      global_head_dim=Holds(">= 0 (0: model.head_dim)", lambda x: x >= 0),
      global_n_kv_heads=Holds(">= 0 (0: model.n_kv_heads)", lambda x: x >= 0),
      global_partial_rotary_factor=Holds("in (0, 1]", lambda x: 0 < x <= 1),
      row_chunks=AT_LEAST_1, gdn_conv=AT_LEAST_1,
      scan_period=Holds(">= 0 (0: the patterns' period)", lambda x: x >= 0),
      gdn_key_heads=Holds(">= 0 (0: model.n_heads)", lambda x: x >= 0),
      gdn_value_heads=Holds(">= 0 (0: model.n_heads)", lambda x: x >= 0),
      gdn_key_dim=Holds(">= 0 (0: model.head_dim)", lambda x: x >= 0),
      gdn_value_dim=Holds(">= 0 (0: model.head_dim)", lambda x: x >= 0),
      partial_rotary_factor=Holds("in (0, 1]", lambda x: 0 < x <= 1),
      attention_impl=OneOf(ATTENTION_IMPLS), param_dtype=OneOf(DTYPES),
      compute_dtype=OneOf(DTYPES), remat=OneOf(REMAT), mlp_activation=OneOf(MLP_ACTIVATIONS))

  @property
  def layer_period(self) -> tuple[str, ...]:
    """The attention types of one period of `layer_pattern`."""
    return comma_list(self.layer_pattern)

  @property
  def mlp_period(self) -> tuple[str, ...]:
    """The MLP kinds of one period of `mlp_pattern` (default: all MoE with experts)."""
    return comma_list(self.mlp_pattern) or (("moe",) if self.moe_experts else ("dense",))

  @property
  def pattern_period(self) -> int:
    """Layers after which both `layer_pattern` and `mlp_pattern` repeat."""
    return math.lcm(len(self.layer_period), len(self.mlp_period))

  @property
  def scan_step(self) -> int:
    """Layers per step of the layer scan: `scan_period`, else the patterns' period."""
    return self.scan_period or self.pattern_period

  def check(self) -> None:
    if self.scan_period % self.pattern_period:
      raise ConfigError(f"model.scan_period={self.scan_period} must be a multiple of the "
                        f"layer and MLP patterns' period, {self.pattern_period}")
    for t in self.layer_period:
      if t not in LAYER_TYPES:
        raise ConfigError(f"model.layer_pattern={self.layer_pattern!r} has the layer type "
                          f"{t!r}; valid types: {list(LAYER_TYPES)}, comma-separated")
    if "gdn" in self.layer_period and (self.gdn_value_heads or self.n_heads) % (
        self.gdn_key_heads or self.n_heads):
      raise ConfigError(f"model.gdn_value_heads={self.gdn_value_heads} must be a multiple of "
                        f"model.gdn_key_heads={self.gdn_key_heads} (0: model.n_heads)")
    if "local" in self.layer_period and self.sliding_window < 1:
      raise ConfigError(f"model.layer_pattern={self.layer_pattern!r} has local layers, whose "
                        f"model.sliding_window must be >= 1 position; got {self.sliding_window}")
    for t in self.mlp_period:
      if t not in MLP_TYPES:
        raise ConfigError(f"model.mlp_pattern={self.mlp_pattern!r} has the MLP type {t!r}; "
                          f"valid types: {list(MLP_TYPES)}, comma-separated")
    has_moe = "moe" in self.mlp_period[:self.n_layers]
    if "moe" in self.mlp_period and not self.moe_experts:
      raise ConfigError(f"model.mlp_pattern={self.mlp_pattern!r} has MoE layers, but "
                        f"model.moe_experts=0")
    if self.moe_experts and not has_moe:
      raise ConfigError(f"model.moe_experts={self.moe_experts}, but model.mlp_pattern="
                        f"{self.mlp_pattern!r} gives none of the {self.n_layers} layers an MoE")
    if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
      raise ConfigError(f"model.moe_top_k={self.moe_top_k} must lie in [1, model.moe_experts="
                        f"{self.moe_experts}]: each token picks k of the E experts")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of "
                        f"model.n_kv_heads={self.n_kv_heads}")
    self._check_rope()
    if self.n_heads % (self.global_n_kv_heads or self.n_kv_heads):
      raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of "
                        f"model.global_n_kv_heads={self.global_n_kv_heads}")
    if (self.moe_beside_dense or self.moe_router_norm) and not self.moe_experts:
      raise ConfigError("model.moe_beside_dense and model.moe_router_norm shape MoE layers, "
                        "but model.moe_experts=0")
    if self.moe_beside_dense and not self.post_norms:
      raise ConfigError("model.moe_beside_dense norms the dense and expert outputs' sum with "
                        "the post-MLP norm: set model.post_norms=true")


  def _check_rope(self) -> None:
    """Each head dim's rotary part (int(dim * partial_rotary_factor), as transformers takes
    it) splits in halves; the RoPE scaling's own rules: models/rope.py, at load."""
    for key in ("head_dim", "global_head_dim"):
      dim = int(getattr(self, key) * self.partial_rotary_factor)
      if dim % 2 and self.partial_rotary_factor == 1:
        raise ConfigError(f"model.{key}={dim} must be even for RoPE")
      if dim % 2:
        raise ConfigError(f"model.{key}={getattr(self, key)} with model.partial_rotary_factor="
                          f"{self.partial_rotary_factor} rotates {dim} dims, which do not split "
                          f"in halves for RoPE")


@dataclasses.dataclass
class DataConfig(Section):
  source: str = "arithmetic"  # embedded default: needs no download
  # file or glob for text / jsonl / array_record / parquet sources (parquet: or a folder of
  # shards); tokens: a folder; hf: a save_to_disk folder or a hub name
  path: str = ""
  # Several sources in place of `path`: "PATH:WEIGHT,PATH:WEIGHT,...", each read as
  # data.source and data.format say, weights normalised (data/pipeline.py).
  mixture: str = ""
  text_field: str = "text"  # key (column) of the text in JSONL / ArrayRecord / Parquet / hf
  messages_field: str = "messages"  # key (column) of a chat record's messages
  hf_split: str = "train"  # data.source=hf: the split of a DatasetDict folder or hub dataset
  hf_revision: str = ""  # data.source=hf with a hub name: its commit, tag or branch
  tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
  # "chat": records that say what is supervised, for SFT (data/chat.py): {"messages": [{"role",
  # "content"}, ...]}, {"prompt", "completion"}, or tokenized {"input_ids", "labels" or
  # "loss_mask"}; what is not supervised is the (never corrupted) prompt. With
  # source=arithmetic each embedded document gives one question ("12+7=") and its answer.
  format: str = "text"
  # Which messages a chat record scores: "assistant" every assistant message, "last" the last
  # one only (the messages before it are its prompt), "all" every token (any record type).
  supervise: str = "assistant"
  # How messages render to text: "plain", "chatml" (ours; EOS ends the response) or
  # "tokenizer" (the data.tokenizer folder's own chat template, as transformers renders it).
  chat_template: str = "plain"
  seq_len: int = 128  # L
  # True: documents are packed several to a row (segment ids 1, 2, ...). False: one document
  # a row, padded at the end (a document longer than L: one row per L-token piece).
  pack: bool = True
  # True: each packed document is its own (segment ids): attention never crosses documents and
  # Gated DeltaNet layers restart their state and conv at each start (docs/gdn.md). False: the
  # row's documents are one continuous stream (segment id 1 up to the row's end padding), as
  # the seed's packed pretraining stream: attention and state cross documents. Only differs
  # from True with data.pack=true; text only (the seed packs chat records aligned to rows).
  segment_ids: bool = True
  shuffle: bool = True
  num_threads: int = 2  # grain read threads (2-core friendly)
  # The held-out split (evaluation). The embedded source draws it from another seed; file
  # sources read `eval_path` (same format) if set, else hold out the last `holdout` fraction
  # of their documents (rounded down), which training then never sees.
  eval_path: str = ""
  holdout: float = 0.01

  RULES = dict(source=OneOf(DATA_SOURCES), format=OneOf(DATA_FORMATS),
               supervise=OneOf(SUPERVISE), chat_template=OneOf(CHAT_TEMPLATES), seq_len=AT_LEAST_1,
               num_threads=AT_LEAST_0, holdout=Holds("in [0, 1)", lambda x: 0 <= x < 1))

  def check(self) -> None:
    if not self.segment_ids and self.format == "chat":
      raise ConfigError("data.segment_ids=false (one continuous stream a row, the seed's "
                        "pretraining packing) reads text documents; data.format='chat' keeps "
                        "each conversation its own (prompt and response): leave it true")
    if self.format == "chat" and self.source not in (*RECORD_SOURCES, "tokens", "arithmetic"):
      raise ConfigError(f"data.format='chat' reads records (data.source="
                        f"{'/'.join(RECORD_SOURCES)}) or the embedded arithmetic as "
                        f"conversations (data.source=arithmetic); got data.source="
                        f"{self.source!r}")
    if self.mixture:
      if self.path or self.eval_path or self.source == "arithmetic":
        raise ConfigError(f"data.mixture={self.mixture!r} names the files in place of "
                          f"data.path and data.eval_path (each source holds out its own "
                          f"data.holdout), from a file source; got data.path={self.path!r}, "
                          f"data.eval_path={self.eval_path!r}, data.source={self.source!r}")
      mixture_entries(self.mixture)
    elif self.source != "arithmetic" and not self.path:
      raise ConfigError(f"data.source={self.source!r} needs data.path")
    if self.format == "chat" and self.chat_template == "tokenizer" and self.tokenizer == "byte":
      raise ConfigError("data.chat_template='tokenizer' renders with the data.tokenizer "
                        "folder's chat template, but data.tokenizer='byte' has none: set "
                        "data.tokenizer to that folder, or use 'plain' or 'chatml'")


def mixture_entries(mixture: str) -> list[tuple[str, float]]:
  """data.mixture "PATH:WEIGHT,..." as [(path, weight / sum of weights)] (a path may hold
  ':', as gs:// does: the weight follows the last one)."""
  entries = []
  for i, entry in enumerate(mixture.split(","), 1):
    path, colon, weight = entry.strip().rpartition(":")
    try:
      value = float(weight)
    except ValueError:
      value = None
    if not (colon and path and value is not None and value > 0 and value != float("inf")):
      raise ConfigError(f"data.mixture entry {i} {entry.strip()!r} must be PATH:WEIGHT with a "
                        f"weight > 0")
    entries.append((path, value))
  total = sum(w for _, w in entries)
  return [(path, w / total) for path, w in entries]


@dataclasses.dataclass
class ObjectiveConfig(Section):
  name: str = "bd3lm"
  block_size: int = 16  # B
  eps_min: float = 1e-3
  eps_max: float = 1.0
  loss_weight: str = "inv_t"  # or "unit"
  mask_token_id: int = 259
  # t of each (sequence, block): antithetic over the batch's blocks (BD3-LM; diffusiongemma:
  # its response blocks), or independent uniforms (the seed's Fast-dLLM v2 runtime); either
  # way clipped to [eps_min, eps_max].
  antithetic: bool = True
  # Keep the [MASK] logit in the softmax of the masked-token CE (the seed's Fast-dLLM v2);
  # False removes it (SUBS). bd3lm and fast_dllm_v2.
  keep_mask_logit: bool = False
  # fast_dllm_v2: the row that scores the first token of block b+1. "clean": the clean row at
  # the end of block b (what the sampler reads); "noisy": the last noisy row of block b, every
  # label on the noisy copies, as the seed trains (docs/conversion_sft.md).
  boundary_row: str = "clean"
  # dflash (docs/dflash.md): up to `max_anchors` draft blocks [x_a, MASK x (B-1)] per
  # sequence, anchors drawn uniformly or strided over the supervised positions; draft slot
  # k >= 1 predicts x_{a+k} with weight exp(-(k-1)/gamma), by cross-entropy to the data
  # ("ce") or by KL divergence from the target's own next-token distribution ("kl").
  max_anchors: int = 8
  anchors: str = "uniform"
  gamma: float = 7.0
  draft_loss: str = "ce"
  # DFlash2 (docs/dflash.md, "DFlash2"): "" keeps the loss above (/ the scored-slot count);
  # "dflash" (the same weights), "dpace" or its ablations weigh slots as the seed does and
  # divide by the global sum of weights; lk_loss "tv" or "lambda" replaces the CE numerator
  # (kl_scale, kl_decay); selector_rank > 0 adds the candidate selector (top-K candidates,
  # its CE times selector_loss_alpha).
  dflash_loss: str = ""
  dpace_alpha: float = 0.5
  lk_loss: str = ""
  kl_scale: float = 1.0
  kl_decay: float = 1.0
  selector_rank: int = 0
  selector_top_k: int = 16
  selector_loss_alpha: float = 1.0
  # diffusiongemma (docs/diffusiongemma.md): canvases corrupted with uniform tokens; each
  # sequence self-conditioned with this probability (a first pass without gradient feeds
  # its logits to the second), and the clean stream's next-token loss added with this weight.
  self_condition_p: float = 0.5
  encoder_loss_weight: float = 1.0

  RULES = dict(block_size=AT_LEAST_1, max_anchors=AT_LEAST_1, gamma=ABOVE_0,
               boundary_row=OneOf(("clean", "noisy")),
               loss_weight=OneOf(("inv_t", "unit")), anchors=OneOf(ANCHOR_SAMPLING),
               draft_loss=OneOf(("ce", "kl")), dflash_loss=OneOf(DFLASH_LOSSES),
               dpace_alpha=Holds("in [0, 1]", lambda x: 0 <= x <= 1),
               lk_loss=OneOf(("", "tv", "lambda")), kl_decay=AT_LEAST_0,
               selector_rank=AT_LEAST_0, selector_top_k=AT_LEAST_1,
               selector_loss_alpha=AT_LEAST_0,
               self_condition_p=Holds("in [0, 1]", lambda x: 0 <= x <= 1),
               encoder_loss_weight=AT_LEAST_0)

  def check(self) -> None:
    if not 0.0 < self.eps_min <= self.eps_max <= 1.0:
      raise ConfigError(f"need 0 < objective.eps_min <= objective.eps_max <= 1, got "
                        f"{self.eps_min}, {self.eps_max}")


@dataclasses.dataclass
class DrafterConfig(Section):
  """objective=dflash: a small block-diffusion drafter over a frozen target, the model that
  `model.*` describes (docs/dflash.md). The drafter shares the target's embedding and
  LM head (so its width is the target's d_model); 0 widths take the target's."""
  target: str = ""  # the frozen target: a Hugging Face folder or a workdir of ours
  # A served DFlash2 drafter folder (config.json + model.safetensors, as mode=export writes
  # and SGLang / vLLM serve; docs/train_dflash.md): a fresh run starts from its weights, and
  # its settings (layers, widths, target layers, block size, mask token, convolutions,
  # selector, window, causality, output multiplier, soft cap) replace the config's at load.
  init_from: str = ""
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
  # DFlash2 (docs/dflash.md): a block-local grouped convolution of `conv_taps` taps (0: none)
  # around each layer's attention and MLP, one dynamic coefficient per `conv_group_size`
  # channels; `window` W > 0 makes every drafter layer sliding-window (a draft slot j at
  # anchor a sees context positions >= a + j - W + 1).
  conv_taps: int = 0
  conv_group_size: int = 16
  window: int = 0
  # Context pruning: each rank keeps this many of its context rows, those some draft slot's
  # window reaches, and drops the rest before `fc` (0: keeps them all); a batch whose anchors
  # reach more keeps more, the width doubled until it holds them (`prune.capacity`: a few
  # widths, each compiled once; docs/dflash.md).
  kept_context_rows: int = 0
  # On sliding-window layers (`window` > 0), draft slot j sees only slots <= j of its own
  # block (the seed's default: causal unless its checkpoint sets `sliding_window_non_causal`,
  # core/models/backbones/dflash/model.py ~364-366); false: the whole block, bidirectionally.
  sliding_causal: bool = False

  RULES = dict(conv_taps=AT_LEAST_0, conv_group_size=AT_LEAST_1, window=AT_LEAST_0,
               kept_context_rows=AT_LEAST_0,
               n_layers=AT_LEAST_1, n_heads=Holds(">= 0 (0: the target's)", lambda x: x >= 0),
               n_kv_heads=Holds(">= 0 (0: the target's)", lambda x: x >= 0),
               head_dim=Holds(">= 0 (0: the target's)", lambda x: x >= 0),
               d_ff=Holds(">= 0 (0: the target's)", lambda x: x >= 0))


@dataclasses.dataclass
class ParallelConfig(Section):
  strategy: str = "none"
  data: int = 1
  fsdp: int = 1
  seq: int = 1
  # dtype of the travelling dK/dV (ring accumulators, all-gather's reduce-scatter); K/V
  # themselves travel in model.compute_dtype.
  kv_grad_dtype: str = "float32"
  # What travels for a drafter's draft attention under a strategy that moves only the context
  # (csbp_*, cp_replicated_drafts): "kv", the context K/V around the ring (or all-gathered);
  # "query", each rank's draft queries with their partial softmax state around the ring, the
  # context K/V staying (parallel/query_ring.py); "auto", our rule: the queries where, on a
  # ring of more than two ranks, a hop of them sends fewer bytes than a hop of the context K/V
  # the rank keeps after pruning (`query_ring.prefers_query_rotation`, `transport_bytes`);
  # "seed", the seed's rule, which counts the K/V of the unpruned context and also asks that
  # the query path's peak memory be the lower (`query_ring.seed_prefers_query_rotation`;
  # docs/dflash.md). A strategy that moves nothing ignores it.
  draft_transport: str = "auto"
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

  RULES = dict(data=AT_LEAST_1, fsdp=AT_LEAST_1, seq=AT_LEAST_1,
               kv_grad_dtype=OneOf(DTYPES), draft_transport=OneOf(DRAFT_TRANSPORTS),
               moe_dispatch=OneOf(MOE_DISPATCHES),
               num_processes=Holds(">= 0 (0: from the environment)", lambda x: x >= 0),
               process_id=Holds(">= -1 (-1: from the environment)", lambda x: x >= -1))

  @property
  def expert_axis_names(self) -> tuple[str, ...]:
    """`expert_axes` as a tuple of mesh axis names."""
    return comma_list(self.expert_axes)

  def check(self) -> None:
    for axis in self.expert_axis_names:
      OneOf(("data", "fsdp", "seq")).check("parallel.expert_axes entry", axis)
    if len(set(self.expert_axis_names)) != len(self.expert_axis_names):
      raise ConfigError(f"parallel.expert_axes={self.expert_axes!r} names an axis twice")


@dataclasses.dataclass
class TrainConfig(Section):
  steps: int = 200
  batch_size: int = 8  # global sequences per optimiser step
  grad_accum: int = 1
  lr: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  # "cosine": linear warm-up from 0, cosine to lr * min_lr_ratio at the last step;
  # "seed_cosine": the seed's (warm-up from the floor, cosine over `steps` after it).
  schedule: str = "cosine"
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8  # Adam's epsilon (the seed's default: 1e-5)
  # Weight decay on every parameter, as the seed's one parameter group; False exempts norm
  # scales and other vectors (per layer, for stacked layer weights).
  decay_vectors: bool = False
  grad_clip: float = 1.0
  log_every: int = 10
  ckpt_every: int = 100
  max_to_keep: int = 3
  async_checkpoint: bool = True
  peak_tflops: float = 0.0  # per device, for the MFU estimate; 0 guesses from the backend
  # Steps with a non-finite loss, gradient or update are skipped; this many in a row stop the run.
  max_bad_steps: int = 3
  eval_every: int = 0  # steps between held-out evaluations (and one at the end); 0: never
  # Parameter groups that get no gradient, no update and no optimiser state: "routers" (every
  # MoE router's projection, input scale and per-expert scale), "" none; "auto": the
  # objective's choice (routers for diffusiongemma, as the seed's native SFT; else none).
  freeze: str = "auto"

  RULES = dict(
      freeze=OneOf(("auto", "", "routers")), schedule=OneOf(("cosine", "seed_cosine")),
      steps=AT_LEAST_1, batch_size=AT_LEAST_1, grad_accum=AT_LEAST_1, log_every=AT_LEAST_1,
      ckpt_every=AT_LEAST_1, max_to_keep=AT_LEAST_1, max_bad_steps=AT_LEAST_1, lr=ABOVE_0,
      warmup_steps=AT_LEAST_0, min_lr_ratio=Holds("in [0, 1]", lambda x: 0 <= x <= 1),
      weight_decay=AT_LEAST_0, b1=Holds("in [0, 1)", lambda x: 0 <= x < 1),
      b2=Holds("in [0, 1)", lambda x: 0 <= x < 1), eps=ABOVE_0,
      grad_clip=Holds("> 0 (the global-norm bound: 0 would zero every update)",
                      lambda x: x > 0),
      peak_tflops=Holds(">= 0 (0: guessed from the backend)", lambda x: x >= 0),
      eval_every=Holds(">= 0 (0: never)", lambda x: x >= 0))

  def check(self) -> None:
    # AdamW moves every weight by about lr a step; weights are ~0.01-1, so from lr ~1 on a
    # step replaces them (train.py skips such steps: MAX_UPDATE_RATIO) and the run cannot train.
    if self.lr >= 1.0:
      warnings.warn(f"train.lr={self.lr:g} cannot train: AdamW moves every weight by about lr "
                    f"each step, and weights are ~0.01-1 (usual lr: 1e-5 to 1e-2); such steps "
                    f"are skipped, and train.max_bad_steps of them in a row stop the run",
                    stacklevel=2)


@dataclasses.dataclass
class SampleConfig(Section):
  """mode=sample: block-wise semi-autoregressive generation from a trained checkpoint.

  [MASK] blocks (bd3lm, fast_dllm_v2) read steps_per_block .. use_cache; DiffusionGemma's
  canvases read denoising_steps .. confidence_threshold (the defaults of transformers'
  DiffusionGemmaGenerationConfig); `ar` reads temperature and use_cache."""
  prompt: str = ""
  prompt_file: str = ""
  max_new_tokens: int = 64
  steps_per_block: int = 0  # 0: one token unmasked per step (block_size steps)
  strategy: str = "confidence"  # or "first_hitting"
  temperature: float = 0.0  # 0: greedy
  use_cache: bool = True  # KV cache of the clean blocks before the current one
  # Also reveal, at each step, every masked token whose confidence is at least this
  # (Fast-dLLM's parallel decoding; 0: off, only the steps_per_block schedule).
  threshold: float = 0.0
  # Fast-dLLM's factor rule: also reveal the k most confident masked tokens where
  # (k + 1)(1 - c_k) < factor, c_k the k-th highest confidence (0: off).
  factor: float = 0.0
  max_batch: int = 64  # prompts per sample_batch call (mode=eval splits its prompts to fit)
  checkpoint_step: int = -1  # -1: latest
  denoising_steps: int = 48  # at most this many denoising steps per canvas
  # Canvas temperature, linear in the steps left: t_max at the first step, t_min at the last.
  t_min: float = 0.4
  t_max: float = 0.8
  # A step accepts the k lowest-entropy tokens whose entropies, less the largest, sum <= this.
  entropy_bound: float = 0.1
  # A canvas stops early when its argmax has not changed for this many steps (0: any) and
  # its mean token entropy is below confidence_threshold.
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  # Comma-separated ids that end generation (any of them); "": the tokenizer's EOS. Imported
  # from a Hugging Face folder's generation_config.json (DiffusionGemma IT: "1,106,50").
  eos_ids: str = ""

  RULES = dict(strategy=OneOf(("confidence", "first_hitting")), max_new_tokens=AT_LEAST_1,
               steps_per_block=Holds(">= 0 (0: one token per step)", lambda x: x >= 0),
               temperature=Holds(">= 0 (0: greedy)", lambda x: x >= 0), checkpoint_step=STEP,
               threshold=Holds("in (0, 1], or 0 for off", lambda x: 0 <= x <= 1),
               factor=Holds("> 0, or 0 for off", lambda x: x >= 0),
               max_batch=AT_LEAST_1,
               denoising_steps=AT_LEAST_1, t_min=AT_LEAST_0, t_max=ABOVE_0,
               entropy_bound=ABOVE_0, stability_threshold=AT_LEAST_0,
               confidence_threshold=ABOVE_0,
               eos_ids=Holds("comma-separated token ids, or empty",
                             lambda x: all(i.strip().isdigit() for i in x.split(",")) if x
                             else True))

  def check(self) -> None:
    if self.t_max < self.t_min:
      raise ConfigError(f"sample.t_max={self.t_max} is below sample.t_min={self.t_min}: the "
                        f"canvas temperature falls from t_max (first step) to t_min (last)")


@dataclasses.dataclass
class EvalConfig(Section):
  """Held-out evaluation (mode=eval, train.eval_every): NELBO / NLL per token, arithmetic."""
  # Held-out batches, the same at every eval, of train.batch_size / train.grad_accum sequences.
  batches: int = 4
  noise_draws: int = 4  # fixed noise draws averaged per batch (diffusion objectives)
  t_min: float = 1e-3  # bd3lm's NELBO integrates t over [t_min, 1] with weight 1/t
  prompts: int = 64  # held-out arithmetic prompts (embedded data only; 0: skip)
  checkpoint_step: int = -1  # mode=eval: -1: latest

  RULES = dict(batches=AT_LEAST_1, noise_draws=AT_LEAST_1,
               t_min=Holds("in (0, 1)", lambda x: 0 < x < 1),
               prompts=Holds(">= 0 (0: no arithmetic eval)", lambda x: x >= 0),
               checkpoint_step=STEP)


@dataclasses.dataclass
class ExportConfig(Section):
  """mode=export: write a Hugging Face folder from a checkpoint."""
  out_dir: str = ""
  checkpoint_step: int = -1  # -1: latest
  dtype: str = "float32"
  # Export into a folder that is not empty, replacing the files an export writes (others stay).
  overwrite: bool = False
  # A DiffusionGemma without the Hugging Face folder it came from (init_from): write the
  # smallest Gemma 4 vision tower, initialised at random by transformers (text use only).
  toy_vision: bool = False

  RULES = dict(checkpoint_step=STEP, dtype=OneOf(DTYPES))


@dataclasses.dataclass
class PlanConfig(Section):
  """mode=plan: compile (never run) the train step under every strategy and compare."""
  # per device; 0: the target's (a TPU chip's HBM, what a GPU reports), else 141 (an H200)
  device_memory_gb: float = 0.0
  # the compiler and devices (bdlm_jax.analysis.targets): cpu (XLA:CPU on this host's
  # devices), tpu:<topology> (XLA:TPU ahead of time, e.g. tpu:v5p:2x2x4), gpu (XLA:GPU)
  target: str = "cpu"
  # also print the chosen strategy's memory at its peak by category, read from XLA's buffer
  # assignment (analysis/buffers.py; one more compile)
  breakdown: bool = False
  # the attention each strategy compiles with: auto = splash on a TPU target (falling back
  # to model.attention_impl where it does not compile), model.attention_impl elsewhere; or
  # one of xla, pallas, splash for every row
  attention: str = "auto"
  # the strategies to compile, comma-separated (e.g. "csbp_ring,cp_ring": at model scale each
  # compile takes minutes); empty: every strategy that can train the objective
  strategies: str = ""

  RULES = dict(device_memory_gb=Holds(">= 0 (0: the target's)", lambda x: x >= 0),
               attention=OneOf(("auto", *ATTENTION_IMPLS)),
               target=Holds("cpu, gpu or tpu:<topology> (e.g. tpu:v5p:2x2x4)",
                            lambda x: x in ("cpu", "gpu") or (x.startswith("tpu:") and
                                                              len(x) > len("tpu:"))))

  @property
  def strategy_names(self) -> tuple[str, ...]:
    """`strategies` as a tuple of names (empty: every strategy)."""
    return comma_list(self.strategies)


@dataclasses.dataclass
class PrepareConfig(Section):
  """mode=prepare: tokenize the corpus once into ArrayRecord shards (data.source=tokens)."""
  out_dir: str = ""  # a local folder; rerunning a killed prepare continues it
  num_processes: int = 0  # tokenizing processes; 0: one per CPU core
  shard_tokens: int = 1 << 26  # a shard closes past this many tokens (256 MiB of int32)

  RULES = dict(num_processes=Holds(">= 0 (0: one per CPU core)", lambda x: x >= 0),
               shard_tokens=AT_LEAST_1)


@dataclasses.dataclass
class PretrainConfig(Section):
  """A first stage the run starts from, the paper's pipeline in small (AR pretraining, then
  AR -> BDLM conversion; docs/usage.md, "Two stages"): `objective` "" for none, else the
  same model and data trained with that objective for `steps` at `lr` into
  <workdir>/pretrain, exported there in Hugging Face format (<workdir>/pretrain/hf), from
  which the run then starts as from `init_from`."""
  objective: str = ""
  steps: int = 600
  lr: float = 3e-3

  RULES = dict(steps=AT_LEAST_1, lr=ABOVE_0)


@dataclasses.dataclass
class Config(Section):
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
  prepare: PrepareConfig = dataclasses.field(default_factory=PrepareConfig)
  pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
  seed: int = 0
  mode: str = "train"  # train | eval | sample | export | plan | prepare
  init_from: str = ""  # a Hugging Face folder whose weights initialise training (conversion)

  RULES = dict(mode=OneOf(MODES),
               seed=Holds("in [0, 2**32) (Grain's shuffle seed range)", lambda x: 0 <= x < 2**32))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "Config":
    return _from_dict(cls, d, prefix="")


# Keys earlier versions wrote into checkpoints' configs that no longer mean anything: read
# and dropped, so those checkpoints still load. parallel.tensor: a reserved axis never used.
RETIRED_KEYS = frozenset({"parallel.tensor"})


def _from_dict(cls, d: dict, prefix: str):
  if not isinstance(d, dict):
    where = f"config section '{prefix[:-1]}'" if prefix else "a config"
    raise ConfigError(f"{where} must be a dict of its keys (or a {cls.__name__}), got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in d.items():
    if f"{prefix}{name}" in RETIRED_KEYS:
      continue
    if name not in fields:
      raise unknown_key(f"{prefix}{name}", [prefix + f for f in fields])
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




def unknown_key(key: str, valid: Iterable[str]) -> ConfigError:
  """The error for a key no section has, with the close spellings (as argparse does)."""
  close = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.6)
  hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
          else "the sections of bdlm_jax/config.py list every key")
  return ConfigError(f"unknown config key '{key}'; {hint}")


def apply_overrides(cfg: Config, overrides: Iterable[str] = ()) -> Config:
  """A copy of `cfg` with `a.b=c` overrides parsed into it (not yet validated)."""
  cfg = Config.from_dict(cfg.to_dict())
  valid = all_keys()
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override '{item}' must look like key=value, e.g. train.steps=10")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key not in valid:
      raise unknown_key(key, valid)
    *path, leaf = key.split(".")
    node = cfg
    for p in path:
      node = getattr(node, p)
    hint = typing.get_type_hints(type(node))[leaf]
    setattr(node, leaf, _coerce(raw, hint, key))
  return cfg


def updated(cfg: Config, **sections: dict) -> Config:
  """A copy of `cfg` with whole sections updated by field (not yet validated)."""
  d = cfg.to_dict()
  for section, values in sections.items():
    if dataclasses.is_dataclass(values):
      values = dataclasses.asdict(values)
    if isinstance(values, dict) and isinstance(d.get(section), dict):
      d[section].update(values)
    else:
      d[section] = values
  return Config.from_dict(d)
