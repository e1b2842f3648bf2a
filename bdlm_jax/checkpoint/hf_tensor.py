"""What Hugging Face interop shares across families: where an HF tensor lives in our params
pytree, and the config.json vocabularies and checks every family reads."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from bdlm_jax.errors import ConfigError
from bdlm_jax.models import rope

LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}  # HF -> ours
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF -> ours


class Rows(NamedTuple):
  """Rows of an HF tensor's out axis, scattered (Qwen3-Next's interleaved in_proj_qkvz)."""
  index: tuple[int, ...]  # the HF rows that make our out axis, in its order
  total: int  # the HF tensor's out-axis size


class Tensor(NamedTuple):
  """Where one HF tensor lives in our params pytree.

  Layer weights are stacked (`layers` holds one array per weight with a leading layer
  axis), so HF's `model.layers.{i}.X` is slice `layer` = i of the array at `path`; expert
  weights have an expert axis next, so `model.layers.{i}.mlp.experts.{e}.X` is slice [i, e]
  (or, where HF stacks a layer's experts in one tensor, HF's leading axis).
  """

  name: str  # HF tensor name
  path: tuple  # keys into our params pytree
  transposed: bool  # HF [..., out, in] vs our kernel [..., in, out] (the last two axes)
  layer: int | None  # index on the stacked layer axis, None for unstacked weights
  offset: float = 0.0  # ours = HF + offset, in float32 (1 for Gemma's (1 + w) norms)
  expert: int | None = None  # index on the expert axis (after the layer axis), if any
  # (i, n): ours is part i of n equal parts of HF's out axis (Gemma 4's fused gate_up_proj)
  part: tuple[int, int] | None = None
  copies: tuple[str, ...] = ()  # other HF names of the same values, written on export
  rows: Rows | None = None  # ours is these rows of HF's out axis (part of a fused projection)

  def hf_shape(self, shape: tuple) -> tuple:
    """The HF tensor's shape, of our slice's `shape`."""
    shape = list(shape)
    if self.transposed:
      shape[-2:] = shape[-2:][::-1]
    if self.part:
      shape[-2] *= self.part[1]
    if self.rows:
      shape[-2] = self.rows.total
    return tuple(shape)

  def hf_index(self, index: tuple, shape: tuple) -> tuple:
    """The HF tensor's index of our slice's `index` (slices; our slice of `shape`)."""
    index = list(index)
    if self.transposed:
      index[-2:] = index[-2:][::-1]
    if self.part:
      size = shape[-1] if self.transposed else shape[-2]
      start, stop, _ = index[-2].indices(size)
      index[-2] = slice(start + self.part[0] * size, stop + self.part[0] * size)
    if self.rows:
      index[-2] = slice(None)  # all of them: `take_rows` picks ours
    return tuple(index)

  def take_rows(self, x: np.ndarray, index: tuple) -> np.ndarray:
    """`x`, the HF tensor read at `hf_index(index, ...)`, cut to our rows where they are
    scattered over its out axis (`rows`)."""
    if not self.rows:
      return x
    ours = index[-1] if self.transposed else index[-2]
    return x[..., np.asarray(self.rows.index)[ours], :]

  def out_rows(self, shape: tuple) -> np.ndarray | None:
    """The rows of the HF tensor's out axis that ours (of `shape`, in HF's layout) fills;
    None: it is the whole HF tensor."""
    if self.rows:
      return np.asarray(self.rows.index)
    if self.part:
      return np.arange(self.part[0] * shape[-2], (self.part[0] + 1) * shape[-2])
    return None

  @property
  def index(self) -> tuple:
    """Which slice of the array at `path` this tensor is: () for a whole array, (layer,)
    for a layer weight, (layer, expert) for an expert's."""
    return tuple(i for i in (self.layer, self.expert) if i is not None)


def shortest_period(kinds: list) -> list:
  """The shortest prefix that repeats to `kinds` (a layer pattern's period)."""
  n = len(kinds)
  return kinds[:next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p]
                                                       for i in range(n)))]


def mlp_pattern(hf: dict, where: str) -> str | None:
  """`model.mlp_pattern` of a Qwen MoE config.json (Qwen3-MoE, Qwen3-Next; `hf` with its
  defaults): layer i's MLP is MoE unless i is in `mlp_only_layers` or (i + 1) is not a
  multiple of `decoder_sparse_step`, as transformers picks it; the layers' kinds as their
  shortest period, "" when every layer is MoE, None when none is."""
  step = int(hf["decoder_sparse_step"])
  if step < 1:
    raise ConfigError(f"{where}: decoder_sparse_step={step} must be >= 1")
  kinds = ["moe" if i not in (hf["mlp_only_layers"] or ()) and (i + 1) % step == 0 else "dense"
           for i in range(hf["num_hidden_layers"])]
  if "moe" not in kinds:
    return None
  return "" if "dense" not in kinds else ",".join(shortest_period(kinds))


def sparse_config(kinds: tuple[str, ...]) -> dict:
  """The config.json keys of a Qwen MoE family that give the layers their MLP `kinds`: the
  dense layers listed (their width is `intermediate_size`)."""
  return {"decoder_sparse_step": 1,
          "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "dense"]}


def require(hf: dict, where: str, key: str, allowed: tuple, what: str) -> None:
  if hf.get(key, allowed[0]) not in allowed:
    raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({what}); bdlm_jax "
                      f"needs {key} in {allowed}")


def shared_config(m, max_positions: int) -> dict:
  """The config.json keys every family this package writes spells alike (`m` a ModelConfig)."""
  return {
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "num_hidden_layers": m.n_layers,
      "num_attention_heads": m.n_heads,
      "num_key_value_heads": m.n_kv_heads,
      "head_dim": m.head_dim,
      "intermediate_size": m.d_ff,
      "rms_norm_eps": m.norm_eps,
      "attention_bias": False,
      "tie_word_embeddings": m.tie_embeddings,
      "max_position_embeddings": max_positions,
  }


# Keys of a config.json's RoPE object that are not its scaling: ModelConfig has fields of
# their own (rope_theta, partial_rotary_factor); "type" is 4.x's spelling of rope_type.
_NOT_SCALING = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def rope_from_hf(params: dict, hf: dict, key: str, where: str, theta: float,
                 rotary_dim: int) -> tuple[float, str]:
  """(base, `model.rope_scaling`) of one RoPE object of a config.json (`key` names it):
  transformers 5's `rope_parameters` or 4.x's `rope_scaling`, completed as transformers
  completes it (the original length from config.json, a YaRN or LongRoPE factor from the
  two lengths, dynamic NTK's starting length)."""
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError(f"{where}: {key}={params} rotates part of the head, which this family "
                      f"does not; bdlm_jax needs partial_rotary_factor 1 here")
  theta = float(params.get("rope_theta", theta))
  scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING and v is not None}
  if kind == "default":
    return theta, ""
  scaling["rope_type"] = kind
  if kind in ("llama3", "yarn", "longrope"):
    scaling["original_max_position_embeddings"] = (
        hf.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
  if kind in ("yarn", "longrope") and scaling.get("factor") is None and hf.get(
      "max_position_embeddings") and scaling.get("original_max_position_embeddings"):
    scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
  if kind in ("dynamic", "longrope"):
    if kind == "dynamic":
      scaling["max_position_embeddings"] = hf.get("max_position_embeddings")
    scaling["seq_len"] = hf.get("max_position_embeddings")  # import_hf sets data.seq_len's
  text = rope.dump(scaling)
  rope.check(f"{where}: {key}", text, rotary_dim)
  return theta, text


def rope_to_hf(text: str, theta: float, **extra) -> dict:
  """A `rope_parameters` object of transformers 5 (4.x's `rope_scaling` too) from a scaling
  and its base; the lengths bdlm_jax fixes length-dependent types at are not written."""
  scaling = {k: v for k, v in rope.parse(text).items()
             if k not in ("seq_len", "max_position_embeddings")}
  return {"rope_type": "default", **scaling, "rope_theta": theta, **extra}


def max_positions_of(text: str, default: int) -> int:
  """config.json's max_position_embeddings: dynamic NTK's starting length where it has one
  (transformers scales from it), else `default`."""
  return rope.parse(text).get("max_position_embeddings", default)
