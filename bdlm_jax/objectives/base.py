"""The objective protocol: what `loss_fn`, the layouts, the sampler, eval and the reports
read from an objective, so that none of them branches on its name.

`loss_fn` runs any objective as rows -> corrupt -> model -> score:
`logical_rows` (host) lays out the logical rows that `make_batch` permutes; in the step
`corrupt` draws the noise, `hidden` runs the model over the rows and returns those of
`LOSS_SLOT`, and `score` sums the loss of one chunk of them.

Optional: `nelbo_config(cfg, t_min) -> objective.* overrides` and `nelbo_corrupt` (`corrupt`'s
signature, weights making `score` a NELBO draw), which a block diffusion objective defines so
that likelihood.py scores a continuation by its NELBO (bd3lm, fast_dllm_v2).
"""

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from bdlm_jax.config import Config, ObjectiveConfig
from bdlm_jax.errors import ConfigError


@runtime_checkable
class Objective(Protocol):
  NAME: str  # objective.name
  LOSS_SLOT: str  # "noisy", "clean" or "all": the rows of each rank whose logits are scored
  NOISY_STREAM: bool  # rows are [x_t ; x_0] (block diffusion), or the clean tokens alone (ar)
  COPIES: int  # sequences `corrupt` runs per batch sequence
  TOKEN_SHIFT: bool  # row i's logits predict token i + 1 of a block (what the sampler reads)
  MASK_TOKEN: bool  # it writes objective.mask_token_id into inputs, so data may not hold it
  # A drafter over a frozen target (dflash): the noisy stream is its draft blocks, the
  # clean stream the target's context, and params are {FROZEN: target, ...: drafter}
  DRAFTER: bool
  FROZEN: tuple[str, ...]  # top-level parameter subtrees that get no gradient
  # What held-out eval's loss is called, and its exp() where that means something
  # (perplexity, or a bound on it), else ""
  HELD_OUT: tuple[str, str]
  FREEZE: str  # what train.freeze=auto freezes (params.frozen_groups): "" or "routers"
  # What a row's `block` holds: "index" (block b's rows hold b; clean rows attend within
  # their block too) or "position" (a noisy row holds its block's first position, a clean
  # row its own: the clean stream is causal, token by token)
  BLOCK_IDS: str
  # How `sample` generates: "mask" ([MASK] blocks revealed step by step), "canvas" (canvases
  # of uniform tokens denoised and re-noised), "ar" (token by token), "" (not alone)
  SAMPLER: str
  ATTEND_ROWS: tuple[str, ...]  # the `make_attend(rows=...)` variants `hidden` uses

  def check_config(self, cfg: Config) -> None:
    """Rules this objective adds to a config (raises ConfigError)."""

  def evaluated(self, cfg: ObjectiveConfig, t_min: float) -> dict:
    """The objective.* overrides under which held-out eval scores it (bd3lm: the NELBO)."""

  def logical_rows(self, tokens_SL, seg_SL, protected_SL, cfg: ObjectiveConfig) -> dict:
    """Host side: the logical rows (labels, maskable, ...) that `make_batch` lays out."""

  def corrupt(self, key, batch, cfg: Config, counts=None) -> tuple:
    """In the step: (batch, inputs, scored, weight); an objective may add copies. `inputs`
    is whatever its `hidden` reads (the rows' input tokens, for most). `counts`: the step's
    `step_counts` (None: this batch's)."""

  def normalizer(self, batch) -> jax.Array:
    """What the step's summed score is divided by, read from the batch before `corrupt`:
    its labelled rows for a per-token mean (`count_labels`), 1 where the weights `corrupt`
    gives already normalise the loss."""

  def step_counts(self, batch) -> dict:
    """The counts `corrupt`'s weights divide by, read from the batch before `corrupt` ({}:
    none, the loss is divided by `normalizer`). An accumulated step reads them from its
    whole batch and passes them to each micro-batch, whose losses then add up to the one
    big batch's (train.py)."""

  def first_passes(self, cfg: Config) -> int:
    """Forward passes over every row that a step runs without gradient before the one it
    differentiates (what the step report adds to the attention traffic)."""

  def hidden(self, spec, model, batch, inputs, layer_weights) -> tuple[Any, tuple, dict]:
    """(final hidden states of the LOSS_SLOT rows, teacher hidden states scored with them,
    router statistics) of one step; `spec` is the resolved step (`bdlm_jax.spec`)."""

  score: Callable[..., jax.Array]  # (logits, labels, scored, weight, *teacher, cfg=) -> sum


def protocol_members() -> tuple[str, ...]:
  """The names an objective must define."""
  methods = [n for n, v in vars(Objective).items() if callable(v) and not n.startswith("_")]
  return tuple(dict.fromkeys([*Objective.__annotations__, *methods]))


def no_first_pass(cfg: Config) -> int:
  """`first_passes` of an objective that runs the model once."""
  del cfg
  return 0


def no_step_counts(batch) -> dict:
  """`step_counts` of an objective whose loss is divided by its `normalizer`."""
  del batch
  return {}


def count_labels(batch) -> jax.Array:
  """The rows with a label (at least 1): the `normalizer` of a per-token mean."""
  return jnp.maximum(jnp.sum(batch.labels >= 0), 1)


def model_hidden(spec, model, batch, inputs, layer_weights):
  """The model over every row of the layout, its LOSS_SLOT rows kept: the `hidden` of every
  objective that trains the model itself on its input tokens."""
  hidden, stats = over_layers(spec, model, batch, model.embed_tokens(inputs), layer_weights)
  return spec.plan.slot_rows(hidden, spec.objective.LOSS_SLOT), (), stats


def over_layers(spec, model, batch, x_BRD, layer_weights):
  """(final hidden states of every row, router statistics) from the first layer's input
  `x_BRD`, with the step's attention, expert dispatch and row chunks. Router statistics count
  the plan's counted rows (each logical row once, the same under every strategy) that are not
  padding."""
  counted = (batch.seg > 0) & spec.plan.counted_rows[None]
  return model.over_layers(x_BRD, batch.pos, batch.meta, spec.attend["all"], layer_weights,
                           counted, spec.dispatch, spec.rows)


def check_block_size(cfg: Config) -> None:
  """Blocks tile the sequence."""
  if cfg.data.seq_len % cfg.objective.block_size:
    raise ConfigError(
        f"data.seq_len={cfg.data.seq_len} is not a multiple of objective.block_size="
        f"{cfg.objective.block_size}; choose a block size that divides the sequence length")
