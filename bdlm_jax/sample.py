"""Generation from every objective through one `sample`: by the objective's `SAMPLER`,
[MASK] blocks revealed step by step (`mask`: bd3lm, fast_dllm_v2), canvases of uniform
tokens denoised and re-noised (`canvas`: diffusiongemma), or token by token (`ar`).

`mask`: generation proceeds one block of B tokens at a time. A new block starts all-[MASK]
and is run as the *noisy* rows of the training stream: bidirectional inside the block,
attending to the clean rows of every earlier block. Each step reveals some masked positions:

* `confidence`: predict every masked position (argmax, or a sample at `temperature`) and
  reveal the most confident ones (probability of the predicted token); `steps_per_block`
  steps split the block evenly (0: B steps, one token each).
* `first_hitting`: the first-hitting sampler of Zheng et al. (2024), used by BD3-LM. Under
  the linear schedule a masked token's unmasking time is uniform on (0, 1), so each
  position draws a time tau and positions are revealed in decreasing tau. With
  steps_per_block = 0 that is one token per step, which is exactly first hitting (the model
  has no time input, so only the order of the hitting times matters); with S steps, step s
  reveals the positions whose tau falls in (1 - (s+1)/S, 1 - s/S] (steps that would reveal
  none are skipped).
* `sample.threshold` > 0 (Fast-dLLM's parallel decoding) also reveals, at each step, every
  masked position whose confidence reaches it; the schedule's positions are still revealed,
  so a block takes at most the schedule's steps and, with one token a step, at least its
  most confident position each step. A block's steps run as one compiled loop.

When the block is complete its clean rows are committed: their keys/values enter a KV
cache, so a denoising step costs O(B x context) and never recomputes the context
(`use_cache=False` recomputes the whole context every step: the reference). A Gated
DeltaNet layer's cache is its recurrent state and causal-conv tail after the last committed
block; a noisy block runs from them (the layer run on concat(context, block), docs/gdn.md).
Generation stops after the block holding EOS. The prompt is placed so that it ends on a
block boundary (like SFT data, data/chat.py); the slots before it are padding (segment 0),
where a recurrent layer's state restarts.

`sample_batch` runs several prompts as the rows of one batch: each prompt ends at the same
slot, its RoPE positions those it would have alone (the slot less its row's pad, a multiple
of B), and a row stops at its own EOS. The prompt region (at least 64 slots) and the batch
are padded to powers of two, so a few shapes compile, whatever the prompt lengths.

For `fast_dllm_v2` (token shift) position j is predicted by row j-1: inside the block by
the noisy row before it, and for the block's first token by the last clean row of the
finished previous block, the row training scores it on (objectives/fast_dllm_v2.py).
The model is run through its own modules (`Block.project`, `Block.finish`, a GDN layer's
`Cell`); only attention is re-wired over [cache ; block]. Sampling uses the `xla` attention,
with the parameters where they lie (`sampling_params`): sharded over a mesh as trained, the
compiler partitions each step.

`canvas`: DiffusionGemma's generation, as transformers' `generation_diffusion_gemma.py`
runs it (`DiffusionGemmaGenerationMixin.generate`, one prompt). Canvases of C =
objective.block_size tokens follow the prompt one after another; each starts as uniform
random tokens (`EntropyBoundSampler.initialize_canvas`) and takes at most
`sample.denoising_steps` steps, counted down N..1. Step n (`_denoising_step`):

* logits of the canvas after the context (`loss.canvas_logits`), self-conditioned on the
  previous step's processed logits (none at the first step);
* processed logits = logits / t, t = t_min + (t_max - t_min) n / N
  (`LinearTemperatureScheduleLogitsProcessor`);
* a denoiser canvas drawn from softmax(processed) (always a draw: greedy is t -> 0), and
  the argmax canvas;
* acceptance (`EntropyBoundSampler.accept_canvas`): the k lowest-entropy positions whose
  entropies, less the largest of them, sum to at most `sample.entropy_bound` take the
  denoiser's token; every other position is re-noised with a uniform token
  (`renoise_canvas`);
* the canvas stops early once its argmax canvas equals each of the previous
  `sample.stability_threshold` steps' and its mean entropy is below
  `sample.confidence_threshold` (`StableAndConfidentStoppingCriteria`).

The canvas kept is the last step's *argmax* canvas, which joins the context. Generation
stops after the canvas holding EOS (`_finalize_canvas`; the tokens after EOS are dropped)
or at max_new_tokens (whole canvases are cut there; transformers keeps the last canvas whole).
With `use_cache` the context (prompt and earlier canvases, causal rows) is committed once to
the KV cache (K/V per attention shape, as the `mask` sampler keeps it), and each step runs
the canvas over it, O(canvas x context); `use_cache=false` recomputes the whole context
through `canvas_logits` at every step (the reference). A canvas's steps run as one compiled
loop, compiled once per generation with the cache (once per canvas without).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.batch import check_token_ids
from bdlm_jax.config import Config, SampleConfig
from bdlm_jax.errors import ConfigError
from bdlm_jax.objectives import get_objective, reserved_mask_id
from bdlm_jax.kernels import with_windows, xla
from bdlm_jax.kernels.mask import CLEAN, NOISY, RowMeta, row_meta
from bdlm_jax.models.pattern import (attention_shape, gdn_shape, layer_types,
                                     split_attention)
from bdlm_jax.params import merge


class KVCache(NamedTuple):
  """The context as of the last committed block, by cache slot: clean keys/values k, v
  {shape: [layers, N, C, Hkv, D]}, one array per attention shape (`_kv_shapes`: Gemma 4's
  global layers have K/V of other head dims and counts than its local ones), and seg int32
  [N, C]; for a model with Gated DeltaNet layers also
  each layer's recurrent state [layers, N, Hv, K, V] (float32) and conv tail, the last
  `gdn_conv - 1` pre-conv rows [layers, N, halo, channels], zero before the prompt (None
  without). Every layer has a slot in each (the other kind's is unused), so the layers still
  run as one scan."""

  k: dict[str, jax.Array]
  v: dict[str, jax.Array]
  seg: jax.Array  # 1 where a slot is filled, 0 = empty or padding (never attended)
  state: jax.Array | None = None
  tail: jax.Array | None = None


def _kv_shapes(m) -> dict[str, tuple[int, int]]:
  """{name: (K/V heads, head dim)} of the K/V arrays a cache keeps: one per attention shape,
  named by the layer kinds that have it ("local" and "global" where they differ)."""
  kinds = [k for k in dict.fromkeys(layer_types(m)) if k != "gdn"] or ["global"]
  if split_attention(m):
    return {kind: attention_shape(m, kind)[:2] for kind in kinds}
  return {"all": attention_shape(m, kinds[0])[:2]}


def empty_cache(m, rows: int, slots: int) -> KVCache:
  """An empty cache of `rows` generations of up to `slots` tokens for model config `m`."""
  kv = {name: jnp.zeros((m.n_layers, rows, slots, h, d), m.compute_dtype)
        for name, (h, d) in _kv_shapes(m).items()}
  state = tail = None
  if "gdn" in m.layer_period:
    hk, hv, dk, dv = gdn_shape(m)
    state = jnp.zeros((m.n_layers, rows, hv, dk, dv), jnp.float32)
    tail = jnp.zeros((m.n_layers, rows, m.gdn_conv - 1, 2 * hk * dk + hv * dv), m.compute_dtype)
  return KVCache(kv, dict(kv), jnp.zeros((rows, slots), jnp.int32), state, tail)


@dataclasses.dataclass
class SampleStats:
  """What generation cost, summed over the calls it is passed to (`sample(..., stats=)`).

  A *denoising forward* predicts a block's masked tokens; for a batch it counts once per
  prompt still generating. With the KV cache each finished block is run once more as clean
  rows to enter the cache (a *commit forward*, one per block, counted apart in
  `commit_forwards`, not fused into the next block's first step). `tokens` counts every
  token revealed, the whole of the block holding EOS included; `ar` counts one token and one
  forward per generated token, a canvas one forward per denoising step."""

  tokens: int = 0
  forwards: int = 0
  commit_forwards: int = 0
  seconds: float = 0.0

  @property
  def tokens_per_forward(self) -> float:
    return self.tokens / max(self.forwards, 1)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(self.seconds, 1e-9)

  def describe(self) -> str:
    return (f"{self.tokens_per_forward:.2f} tokens per forward ({self.tokens} tokens, "
            f"{self.forwards} denoising forwards, {self.commit_forwards} cache commits), "
            f"{self.tokens_per_s:.1f} tokens/s")


def _meta(stream: int, slot_NR, seg_NR, block_size: int) -> RowMeta:
  return row_meta(jnp.full_like(slot_NR, stream), slot_NR // block_size,
                  seg_NR.astype(jnp.int32), slot_NR)


def _doc_starts(seg_NR, prev_N):
  """bool [N, R]: the rows whose document differs from the row before (`prev_N` before the
  first): the prompt's first row after its padding."""
  return seg_NR != jnp.concatenate([prev_N[:, None], seg_NR[:, :-1]], 1)


def _rows_forward(model, tokens_NR, pos_NR, meta: RowMeta, cache: KVCache, start,
                  block_size: int, chunk: int, x_NRD=None):
  """Hidden states of rows (cache slots start..) attending to [cache ; themselves], and each
  layer's new cache entries: the rows' K/V, and a Gated DeltaNet layer's state and conv tail
  after them (run from the cache's). `x_NRD`: the first layer's input, if not the tokens'
  embeddings (a self-conditioned canvas)."""
  n, r = tokens_NR.shape
  cache_slot = jnp.broadcast_to(jnp.arange(cache.seg.shape[1])[None], cache.seg.shape)
  kv_meta = _meta(CLEAN, cache_slot, cache.seg, block_size).concat(meta)
  attend = with_windows(functools.partial(xla.attend, chunk=chunk), block_size)
  prev_seg = jnp.where(start > 0, jax.lax.dynamic_index_in_dim(cache.seg, jnp.maximum(start - 1, 0),
                                                               1, keepdims=False), 0)
  starts_NR = _doc_starts(meta.seg, prev_seg)
  no_kv = {name: jnp.zeros((n, r, *a.shape[3:]), a.dtype) for name, a in cache.k.items()}
  split = "all" not in no_kv

  def layer(block, x, k_cache, v_cache, state, tail, kind):
    if kind == "gdn":
      pre, z, g, beta = block.linear_attn.project(block.attn_norm(x))
      starts = jnp.concatenate([jnp.zeros(tail.shape[:2], bool), starts_NR], 1)
      o, state = block.linear_attn.cell()(pre, tail, g, beta, state, starts, starts_NR)
      in_doc = (meta.seg > 0)[..., None].astype(pre.dtype)  # the tail is zero before the prompt
      tail = jnp.concatenate([tail, pre * in_doc], 1)[:, -tail.shape[1]:]
      return block.finish(x, block.linear_attn.gated_norm(o, z))[0], (no_kv, no_kv, state, tail)
    q, k, v, *gate = block.project(x, pos_NR, kind)
    name = kind if split else "all"  # the other shapes' slots of this layer stay unused
    k_all = jnp.concatenate([k_cache[name], k], axis=1)
    v_all = jnp.concatenate([v_cache[name], v], axis=1)
    out, _ = attend(q, k_all, v_all, meta, kv_meta, window=block.window(kind))
    if gate:
      out = out * jax.nn.sigmoid(gate[0])
    return block.finish(x, out)[0], ({**no_kv, name: k}, {**no_kv, name: v}, state, tail)

  x = model.embed_tokens(tokens_NR) if x_NRD is None else x_NRD
  x, ys = model.scan_layers(layer, x, cache.k, cache.v, cache.state, cache.tail)
  return model.final_norm(x), ys


def _full_recur(block_size: int):
  """`attend.recur` of the rows [clean context C ; a noisy block] (use_cache=false): the
  clean rows run as one causal stream up to the block's first slot (the rows from there on,
  empty, leave the state alone), and the block from that state with the conv reading the
  clean rows before it: the layer run on concat(clean[:start], block) (docs/gdn.md)."""
  def recur(cell, pre_NRC, g_NRH, beta_NRH, meta):
    n, c = pre_NRC.shape[0], pre_NRC.shape[1] - block_size
    start = meta.pos[0, c]
    seg = meta.seg[:, :c]
    starts = _doc_starts(seg, jnp.zeros(n, seg.dtype))
    real = jnp.arange(c)[None] < start
    keep = lambda a: jnp.where(real[..., None], a[:, :c], 0)
    no_left = jnp.zeros((n, cell.halo), bool)
    starts_left = jnp.concatenate([no_left, starts], 1)
    o_clean, state = cell(pre_NRC[:, :c], None, keep(g_NRH), keep(beta_NRH), None, starts_left,
                          starts & real)
    pre_left = jnp.concatenate([jnp.zeros_like(pre_NRC[:, :cell.halo]), pre_NRC[:, :c]], 1)
    left = jax.lax.dynamic_slice_in_dim(pre_left, start, cell.halo, 1)
    left_starts = jax.lax.dynamic_slice_in_dim(starts_left, start, cell.halo, 1)
    block_starts = jnp.concatenate([left_starts, jnp.zeros((n, block_size), bool)], 1)
    o_block, _ = cell(pre_NRC[:, c:], left, g_NRH[:, c:], beta_NRH[:, c:], state, block_starts,
                      jnp.zeros((n, block_size), bool))
    return jnp.concatenate([o_clean, o_block], 1)
  return recur


def _slots(start, n_rows: int, rows: int):
  return jnp.broadcast_to(start + jnp.arange(rows)[None], (n_rows, rows))


def _commit_rows(model, cache: KVCache, tokens_NR, seg_NR, start, block_size: int, chunk: int,
                 pad_N1=0):
  """Runs clean rows in cache slots start.. over [cache ; themselves] and writes their K/V into
  the cache: (hidden states [N, R, D], cache). Slot s of row n holds position s - pad[n]
  (RoPE): masks compare slots, which keep each row's order and block boundaries where the
  pads are multiples of the block size."""
  slot = _slots(start, *tokens_NR.shape)
  meta = _meta(CLEAN, slot, seg_NR, block_size)
  h, (k, v, state, tail) = _rows_forward(model, tokens_NR, slot - pad_N1, meta, cache, start,
                                         block_size, chunk)
  at = (0, 0, start, 0, 0)
  write = lambda into, rows: jax.lax.dynamic_update_slice(into, rows, at)
  return h, KVCache(jax.tree.map(write, cache.k, k), jax.tree.map(write, cache.v, v),
                    jax.lax.dynamic_update_slice(cache.seg, seg_NR.astype(jnp.int32), (0, start)),
                    state, tail)


def _predict(logits_RV, key, temperature):
  """Argmax (temperature 0) or a sample at `temperature` (Gumbel-max), per row."""
  noisy = logits_RV / jnp.maximum(temperature, 1e-6) + jax.random.gumbel(key, logits_RV.shape)
  return jnp.where(temperature > 0, jnp.argmax(noisy, -1), jnp.argmax(logits_RV, -1))


_pick = jax.jit(_predict)


def reveal(logits_NBV, tokens_NB, masked_NB, n, key, temperature, priority_B, threshold,
           factor, by_confidence: bool):
  """One denoising step of N blocks: (tokens, masked) after revealing, in each, the `n`
  masked positions of highest priority (the confidence of the predicted token where
  `by_confidence`, else `priority_B`), and every masked position whose confidence is at least
  `threshold` (0: none beyond the n), and, by Fast-dLLM's factor rule, the k most confident
  masked positions where (k + 1)(1 - c_k) < `factor` (c_k: the k-th highest confidence; 0:
  off). Every block draws from `key` as if it were alone."""
  pred_NB = jax.vmap(lambda logits_BV: _predict(logits_BV, key, temperature))(logits_NBV)
  confidence_NB = jnp.take_along_axis(jax.nn.softmax(logits_NBV), pred_NB[..., None], -1)[..., 0]
  priority_NB = confidence_NB if by_confidence else jnp.broadcast_to(priority_B, pred_NB.shape)
  rank_NB = jnp.argsort(jnp.argsort(-jnp.where(masked_NB, priority_NB, -jnp.inf), -1), -1)
  sure_NB = (threshold > 0) & (confidence_NB >= threshold)
  by_rank_NB = jnp.argsort(jnp.argsort(-jnp.where(masked_NB, confidence_NB, -jnp.inf), -1), -1)
  sure_NB |= (factor > 0) & ((by_rank_NB + 2) * (1 - confidence_NB) < factor)
  now_NB = masked_NB & ((rank_NB < n) | sure_NB)
  return jnp.where(now_NB, pred_NB, tokens_NB), masked_NB & ~now_NB


class _Steps(NamedTuple):
  """The jitted pieces of one model/objective configuration; compiled once per shape (batch
  and context length bucketed by `_layout`)."""

  # (params, cache, tokens_NR, seg_NR, start, pad_N1) -> (cache, next-token logits [N, V])
  commit: Callable
  # (params, cache, tokens_NB, start, pad_N1) -> logits [N, B, V] over the cache
  denoise: Callable
  # (params, ctx_NC, seg_NC, tokens_NB, start, pad_N1) -> ([N, B, V], row start-1's [N, V])
  denoise_full: Callable
  # (params, cache | (ctx, seg), prev_NV, start, pad_N1, masked_NB, key, counts_S, priority_B,
  #  temperature, threshold, factor; by_confidence, use_cache)
  #  -> (tokens [N, B], denoising forwards [N])
  block: Callable


@functools.lru_cache(maxsize=8)
def _steps(cfg_json: str) -> _Steps:
  cfg = Config.from_dict(json.loads(cfg_json))
  bs, mask_id = cfg.objective.block_size, cfg.objective.mask_token_id
  chunk = cfg.model.attention_chunk
  shift = get_objective(cfg.objective.name).TOKEN_SHIFT

  def commit(params, cache, tokens_NR, seg_NR, start, pad_N1):
    model = merge(cfg, params)
    h, cache = _commit_rows(model, cache, tokens_NR, seg_NR, start, bs, chunk, pad_N1)
    return cache, model.logits(h[:, -1:])[:, 0] if shift else None  # next block's first token

  def denoise(params, cache, tokens_NB, start, pad_N1):
    model = merge(cfg, params)
    slot = _slots(start, *tokens_NB.shape)
    meta = _meta(NOISY, slot, jnp.ones_like(slot), bs)
    return model.logits(_rows_forward(model, tokens_NB, slot - pad_N1, meta, cache, start, bs,
                                      chunk)[0])

  def denoise_full(params, ctx_NC, seg_NC, tokens_NB, start, pad_N1):
    """Rows: the clean context, then this block's noisy rows. Also returns the logits of
    clean row start-1, which predict this block's first token under the shift."""
    model = merge(cfg, params)
    n, c = ctx_NC.shape
    ctx_slot, slot = _slots(0, n, c), _slots(start, *tokens_NB.shape)
    meta = _meta(CLEAN, ctx_slot, seg_NC, bs).concat(_meta(NOISY, slot, jnp.ones_like(slot), bs))
    attend = with_windows(functools.partial(xla.attend, chunk=chunk), bs)
    attend.recur = _full_recur(bs)
    h = model(jnp.concatenate([ctx_NC, tokens_NB], 1),
              jnp.concatenate([ctx_slot, slot], 1) - pad_N1, meta, attend)
    return model.logits(h[:, c:]), model.logits(jax.lax.dynamic_slice_in_dim(h, start - 1, 1,
                                                                              1))[:, 0]

  def block(params, context, prev_NV, start, pad_N1, masked_NB, key, counts_S, priority_B,
            temperature, threshold, factor, by_confidence, use_cache):
    """A block's denoising steps as one loop: step s reveals counts_S[s] positions (and those
    above the threshold) until none is masked; a row starting with nothing masked (its
    generation has ended) counts no forward."""
    def step(state):
      s, tokens_NB, masked_NB, forwards_N = state
      if use_cache:
        logits = denoise(params, context, tokens_NB, start, pad_N1)
        prev = prev_NV
      else:
        logits, prev = denoise_full(params, *context, tokens_NB, start, pad_N1)
      if shift:
        logits = jnp.concatenate([prev[:, None], logits[:, :-1]], 1)
      logits = logits.at[..., mask_id].set(-jnp.inf)  # [MASK] is never a prediction
      tokens_NB, now_masked = reveal(logits, tokens_NB, masked_NB, counts_S[s],
                                     jax.random.fold_in(key, s), temperature, priority_B,
                                     threshold, factor, by_confidence)
      return s + 1, tokens_NB, now_masked, forwards_N + jnp.any(masked_NB, -1)

    tokens = jnp.full(masked_NB.shape, mask_id, jnp.int32)
    state = (jnp.int32(0), tokens, masked_NB, jnp.zeros(masked_NB.shape[0], jnp.int32))
    _, tokens, _, forwards = jax.lax.while_loop(
        lambda st: (st[0] < counts_S.shape[0]) & jnp.any(st[2]), step, state)
    return tokens, forwards

  return _Steps(jax.jit(commit), jax.jit(denoise), jax.jit(denoise_full),
                jax.jit(block, static_argnames=("by_confidence", "use_cache")))


def _schedule(strategy: str, block_size: int, steps: int, key) -> tuple[np.ndarray, np.ndarray]:
  """(tokens revealed at each step: int32 [B], its steps first and zeros after; the priority
  of each position, unused for `confidence`). A first-hitting step that reveals nothing is
  dropped: it would cost a forward and change nothing."""
  if strategy == "confidence":
    s = min(steps or block_size, block_size)
    counts = [block_size // s + (i < block_size % s) for i in range(s)]
    priority = np.zeros(block_size, np.float32)
  else:
    priority = np.asarray(jax.random.uniform(key, (block_size,)))  # unmasking times, linear
    if steps:
      step_of = np.minimum(((1.0 - priority) * steps).astype(int), steps - 1)  # tau in
      counts = [c for c in np.bincount(step_of, minlength=steps) if c]  # (1-(s+1)/S, 1-s/S]
    else:
      counts = [1] * block_size
  return np.pad(np.asarray(counts, np.int32), (0, block_size - len(counts))), priority


class _Options(NamedTuple):
  max_new_tokens: int
  steps_per_block: int
  strategy: str
  temperature: float
  use_cache: bool
  eos_id: tuple[int, ...]
  threshold: float
  factor: float


def _options(cfg: Config, max_new_tokens=None, steps_per_block=None, strategy=None,
             temperature=None, use_cache=None, eos_id=None, threshold=None,
             factor=None) -> _Options:
  """`sample`'s options, each defaulting to `cfg.sample`, checked."""
  o = cfg.sample
  pick = lambda given, default: default if given is None else given
  got = _Options(pick(max_new_tokens, o.max_new_tokens), pick(steps_per_block, o.steps_per_block),
                 pick(strategy, o.strategy), pick(temperature, o.temperature),
                 pick(use_cache, o.use_cache),
                 stop_ids(cfg) if eos_id is None else tuple(np.atleast_1d(eos_id).tolist()),
                 pick(threshold, o.threshold), pick(factor, o.factor))
  objective = get_objective(cfg.objective.name)
  if not objective.SAMPLER:
    raise ConfigError(f"objective={cfg.objective.name} does not generate alone (a drafter "
                      f"proposes blocks for its target); experiments/dflash_tau.py measures "
                      f"its acceptance")
  if got.max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens must be >= 1, got {got.max_new_tokens}")
  if got.strategy not in ("confidence", "first_hitting"):
    raise ConfigError(f"sample strategy {got.strategy!r} is not 'confidence' or 'first_hitting'")
  if got.steps_per_block < 0:
    raise ConfigError(f"sample.steps_per_block must be >= 0, got {got.steps_per_block}")
  if not 0 <= got.threshold <= 1:
    raise ConfigError(f"sample.threshold must be in (0, 1], or 0 for off; got {got.threshold}")
  if got.factor < 0:
    raise ConfigError(f"sample.factor must be > 0, or 0 for off; got {got.factor}")
  return got


def _checked_prompt(cfg: Config, prompt_tokens, what: str) -> np.ndarray:
  prompt = np.asarray(prompt_tokens).reshape(-1)
  if not prompt.size:
    raise ConfigError(f"{what} is empty: generation needs at least one prompt token")
  check_token_ids(cfg, prompt, what)
  if prompt.size > cfg.data.seq_len:  # not refused: an imported model may know longer ones
    warnings.warn(f"{what} has {prompt.size} tokens, more than data.seq_len="
                  f"{cfg.data.seq_len}, the context the model was trained at: positions past "
                  f"{cfg.data.seq_len} were not trained, and the completion may be noise")
  return prompt.astype(np.int32)


def sample(params, cfg: Config, prompt_tokens, key, *, max_new_tokens: int | None = None,
           steps_per_block: int | None = None, strategy: str | None = None,
           temperature: float | None = None, use_cache: bool | None = None,
           eos_id: int | Sequence[int] | None = None, threshold: float | None = None,
           factor: float | None = None, stats: SampleStats | None = None) -> np.ndarray:
  """Tokens generated after `prompt_tokens` (int [T]): int32 [<= max_new_tokens].

  Block diffusion objectives generate block by block, DiffusionGemma canvas by canvas
  (above); `ar` decodes one token at a time with a KV cache (the block options do not apply;
  nor do they to canvases, which read the sample.* canvas options). Options default to
  `cfg.sample`; `eos_id` (one id or a list: generation stops at any of them) defaults to
  `sample.eos_ids` (an imported folder's generation config sets it), else the EOS of
  `data.tokenizer`. `threshold` (0: off) also reveals, at each step, every masked position
  whose confidence reaches it, `factor` (0: off) those Fast-dLLM's factor rule picks. The
  result ends with its EOS if generation stopped there. Same key, same tokens, with or
  without the KV cache. Prompt ids must index the embedding and not be the [MASK] id.
  `stats`, if given, accumulates the forwards and time spent.
  """
  opts = _options(cfg, max_new_tokens, steps_per_block, strategy, temperature, use_cache, eos_id,
                  threshold, factor)
  return _generate(params, cfg, [_checked_prompt(cfg, prompt_tokens, "the prompt")], key, opts,
                   stats)[0]


def sample_batch(params, cfg: Config, prompts: Sequence, key, *, stats: SampleStats | None = None,
                 **options) -> list[np.ndarray]:
  """`sample` of each of `prompts` (int [T_i], lengths may differ) with the same `key` and
  options, in one batch for the [MASK] objectives: element i equals `sample(params, cfg,
  prompts[i], key, **options)`. At most `sample.max_batch` prompts. The batch and the prompt
  region are padded to powers of two (in blocks), so a few shapes compile, not one per
  prompt length; `ar` and canvas objectives generate prompt by prompt."""
  opts = _options(cfg, **options)
  if not len(prompts) or len(prompts) > cfg.sample.max_batch:
    raise ConfigError(f"sample_batch needs 1 to sample.max_batch={cfg.sample.max_batch} "
                      f"prompts, got {len(prompts)}")
  checked = [_checked_prompt(cfg, p, f"prompt {i}") for i, p in enumerate(prompts)]
  return _generate(params, cfg, checked, key, opts, stats)


def _generate(params, cfg: Config, prompts: list[np.ndarray], key, opts: _Options,
              stats: SampleStats | None) -> list[np.ndarray]:
  stats = SampleStats() if stats is None else stats
  began = time.perf_counter()
  sampler = get_objective(cfg.objective.name).SAMPLER
  if sampler == "mask":
    out = _sample_mask(params, cfg, prompts, key, opts, stats)
  elif sampler == "canvas":
    out = [_sample_canvas(params, cfg, p, key, opts.max_new_tokens, opts.eos_id, opts.use_cache,
                          stats) for p in prompts]
  else:  # "ar": token by token
    out = [_sample_ar(params, cfg, p, key, opts.max_new_tokens, opts.temperature, opts.use_cache,
                      opts.eos_id, stats) for p in prompts]
  stats.seconds += time.perf_counter() - began
  return out


def _bucket(n: int) -> int:
  """The power of two >= n: the padded sizes that bound compiles."""
  return 1 << max(n - 1, 0).bit_length()


# The shortest prompt region (slots, rounded up to blocks): padding a short prompt to it costs
# less than compiling another shape (the quickstart's eval: 0.4 s of sampling, ~5 s a compile).
_MIN_PROMPT_SLOTS = 64


def _sample_mask(params, cfg: Config, prompts: list[np.ndarray], key, o: _Options,
                 stats: SampleStats) -> list[np.ndarray]:
  """Block-by-block generation of every prompt at once (module docstring). Row n's prompt ends
  at slot `first`, the same for all rows; its RoPE positions are its slots less pad[n], the
  positions `first_n` = its own length rounded up to blocks would give it alone."""
  m, bs = cfg.model, cfg.objective.block_size
  fns = _steps(_model_json(cfg))
  own_first = np.asarray([-p.size % bs + p.size for p in prompts])
  first = bs * _bucket(-(-max(int(own_first.max()), _MIN_PROMPT_SLOTS) // bs))
  n_rows, n_blocks = _bucket(len(prompts)), -(-o.max_new_tokens // bs)
  pad_N1 = np.zeros((n_rows, 1), np.int32)
  pad_N1[:len(prompts), 0] = first - own_first
  ctx = np.zeros((n_rows, first + n_blocks * bs), np.int32)
  seg = np.zeros_like(ctx)
  for n, p in enumerate(prompts):
    ctx[n, first - p.size:first], seg[n, first - p.size:first] = p, 1
  live = np.arange(n_rows) < len(prompts)  # rows still generating (padding rows never are)
  prev = None
  if o.use_cache:
    cache = empty_cache(m, n_rows, ctx.shape[1])
    cache, prev = fns.commit(params, cache, ctx[:, :first], seg[:, :first], 0, pad_N1)
  out = [[] for _ in prompts]
  for b in range(n_blocks):
    start = first + b * bs
    block_key = jax.random.fold_in(key, b)
    counts, priority = _schedule(o.strategy, bs, o.steps_per_block, block_key)
    context = cache if o.use_cache else (ctx, seg)
    tokens, forwards = fns.block(params, context, prev, start, pad_N1,
                                 np.repeat(live[:, None], bs, 1), block_key, counts, priority,
                                 o.temperature, o.threshold, o.factor,
                                 by_confidence=o.strategy == "confidence", use_cache=o.use_cache)
    tokens = np.asarray(tokens)
    stats.forwards += int(np.sum(forwards))
    stats.tokens += int(live.sum()) * bs
    for n in np.flatnonzero(live[:len(prompts)]):
      out[n].extend(tokens[n].tolist())
      live[n] = not set(o.eos_id) & set(tokens[n].tolist())
    if not live.any() or b + 1 == n_blocks:
      break
    ctx[:, start:start + bs], seg[:, start:start + bs] = tokens, live[:, None]
    if o.use_cache:
      cache, prev = fns.commit(params, cache, tokens, seg[:, start:start + bs], start, pad_N1)
      stats.commit_forwards += int(live.sum())
  return [_until_eos(tokens, o.max_new_tokens, o.eos_id) for tokens in out]


def sampling_params(params):
  """`params` as the sampler reads them: where they lie, when this host holds every shard
  (the compiler runs each jitted step over the shards, so a model sharded to train, e.g. by
  `parallel.fsdp`, samples sharded, never gathered onto one device); gathered here where
  other hosts hold some (the sampler's host loop reads whole arrays)."""
  if all(x.is_fully_addressable for x in jax.tree.leaves(params)):
    return params
  from bdlm_jax.parallel.mesh import to_host
  return jax.tree.map(to_host, params)


def stop_ids(cfg: Config) -> tuple[int, ...]:
  """`sample.eos_ids`, else the EOS of `data.tokenizer`."""
  if cfg.sample.eos_ids:
    return tuple(int(i) for i in cfg.sample.eos_ids.split(","))
  return (checked_tokenizer(cfg).eos_id,)


def _until_eos(tokens: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> np.ndarray:
  """The first max_new_tokens tokens, cut after the first EOS (any of `eos_ids`)."""
  tokens = tokens[:max_new_tokens]
  ends = [i for i, t in enumerate(tokens) if t in eos_ids]
  return np.asarray(tokens[:ends[0] + 1] if ends else tokens, np.int32)


class CanvasStep(NamedTuple):
  """One denoising step of a canvas of C tokens (`_denoising_step` in transformers)."""

  canvas: jax.Array  # int32 [C]: the next step's input: `accepted`, the rest re-noised
  accepted: jax.Array  # int32 [C]: the denoiser's token where accepted, else the input's
  argmax: jax.Array  # int32 [C]: argmax of the processed logits
  logits: jax.Array  # float32 [C, V]: the processed (temperature-scaled) logits
  entropy: jax.Array  # float32 [C]: entropy of softmax(logits)


def token_entropy(logits_CV) -> jax.Array:
  """Entropy of softmax(logits) per position (`torch.distributions.Categorical.entropy`,
  which also clamps log-probabilities: a -inf logit adds 0, not NaN)."""
  log_p = jnp.maximum(jax.nn.log_softmax(logits_CV.astype(jnp.float32), axis=-1),
                      jnp.finfo(jnp.float32).min)
  return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def entropy_bound_accepts(entropy_C, bound: float) -> jax.Array:
  """bool [C]: the k lowest-entropy positions with sum - max of their entropies <= `bound`
  (`EntropyBoundSampler.accept_canvas`); the lowest is always accepted."""
  order = jnp.argsort(entropy_C, stable=True)
  sorted_C = entropy_C[order]
  return jnp.zeros(entropy_C.shape, bool).at[order].set(jnp.cumsum(sorted_C) - sorted_C <= bound)


def stable_and_confident(history_HC, argmax_C, entropy_C, confidence_threshold: float):
  """(stop, history) as `StableAndConfidentStoppingCriteria`: stable when `argmax_C` equals
  each of the H previous argmax canvases in `history_HC` (oldest first; -1 before a canvas's
  first steps; H = stability_threshold, 0: always stable), confident when the mean entropy is
  below `confidence_threshold`. `history` drops the oldest and ends with `argmax_C`."""
  stable = jnp.all(history_HC == argmax_C[None])
  history_HC = jnp.concatenate([history_HC, argmax_C[None]])[1:]
  return stable & (jnp.mean(entropy_C) < confidence_threshold), history_HC


def canvas_temperature(o: SampleConfig, step) -> jax.Array:
  """`LinearTemperatureScheduleLogitsProcessor`: t_max at step N (the first), t_min at 0."""
  return o.t_min + (o.t_max - o.t_min) * (jnp.asarray(step, jnp.int32) / o.denoising_steps)


def denoising_step(params, cfg: Config, context_1T, canvas_C, self_conditioning_CV, step,
                   key) -> CanvasStep:
  """Step `step` (N..1: the steps left) of the canvas `canvas_C` after `context_1T`,
  self-conditioned on the previous step's processed logits (None at the first step)."""
  from bdlm_jax.loss import canvas_logits  # loss imports the strategies
  given = None if self_conditioning_CV is None else self_conditioning_CV[None]
  return _step_from_logits(cfg, canvas_logits(params, cfg, context_1T, canvas_C[None],
                                              given)[0], canvas_C, step, key)


def _cached_canvas_logits(params, cfg: Config, cache: KVCache, t, canvas_C,
                          self_conditioning_CV) -> jax.Array:
  """`canvas_logits` [C, V] of the canvas after the context held in `cache` (slots < t, its
  rows committed causally): one block of noisy rows at positions t.., over the cache."""
  from bdlm_jax.loss import canvas_embeddings
  model = merge(cfg, params)
  canvas_1C = canvas_C[None]
  slot = _slots(t, *canvas_1C.shape)
  meta = row_meta(jnp.full_like(slot, NOISY), jnp.full_like(slot, t), jnp.ones_like(slot), slot)
  given = None if self_conditioning_CV is None else self_conditioning_CV[None]
  x = canvas_embeddings(model, cfg, canvas_1C, given)
  h, _ = _rows_forward(model, canvas_1C, slot, meta, cache, t, 1, cfg.model.attention_chunk, x)
  return model.logits(h)[0]


def _step_from_logits(cfg: Config, logits, canvas_C, step, key) -> CanvasStep:
  """`denoising_step` from the canvas's logits [C, V]."""
  o, vocab = cfg.sample, cfg.model.vocab_size
  logits = logits / canvas_temperature(o, step)
  draw_key, noise_key = jax.random.split(key)
  denoised = jax.random.categorical(draw_key, logits).astype(jnp.int32)
  entropy = token_entropy(logits)
  take = entropy_bound_accepts(entropy, o.entropy_bound)
  accepted = jnp.where(take, denoised, canvas_C)
  noise = jax.random.randint(noise_key, canvas_C.shape, 0, vocab, jnp.int32)
  return CanvasStep(jnp.where(take, accepted, noise), accepted,
                    jnp.argmax(logits, -1).astype(jnp.int32), logits, entropy)


class _Denoising(NamedTuple):
  """The state of a canvas between steps."""

  step: jax.Array  # the next step (N..1); 0: none left
  canvas: jax.Array  # int32 [C]
  argmax: jax.Array  # int32 [C]: the latest argmax canvas
  self_conditioning: jax.Array | None  # [C, V]: processed logits in param_dtype (None: off)
  history: jax.Array  # int32 [H, C]: argmax canvases for the stability rule
  stop: jax.Array  # bool: stable and confident


@functools.lru_cache(maxsize=8)
def _canvas_denoiser(cfg_json: str, use_cache: bool) -> Callable:
  """jit (params, context, canvas_C, key) -> (the argmax canvas int32 [C] after at most N
  steps from `canvas_C`, the steps taken); step n draws from fold_in(key, n). The context:
  (KV cache, its length t) with `use_cache`, else its tokens [1, T], recomputed each step."""
  cfg = Config.from_dict(json.loads(cfg_json))
  o, c = cfg.sample, cfg.objective.block_size
  self_conditioning = cfg.model.self_conditioning

  def advance(params, context, key, state: _Denoising) -> _Denoising:
    step_key = jax.random.fold_in(key, state.step)
    if use_cache:
      logits = _cached_canvas_logits(params, cfg, *context, state.canvas,
                                     state.self_conditioning)
      out = _step_from_logits(cfg, logits, state.canvas, state.step, step_key)
    else:
      out = denoising_step(params, cfg, context, state.canvas, state.self_conditioning,
                           state.step, step_key)
    stop, history = stable_and_confident(state.history, out.argmax, out.entropy,
                                         o.confidence_threshold)
    # transformers feeds the processed logits back in the embedding's dtype
    logits = out.logits.astype(cfg.model.param_dtype) if self_conditioning else None
    return _Denoising(state.step - 1, out.canvas, out.argmax, logits, history, stop)

  def denoise(params, context, canvas, key):
    start = _Denoising(jnp.int32(o.denoising_steps), canvas, canvas, None,
                       jnp.full((o.stability_threshold, c), -1, jnp.int32), jnp.bool_(False))
    # The first step has no self-conditioning logits: a loop state of its own
    state = advance(params, context, key, start)
    state = jax.lax.while_loop(lambda s: (s.step >= 1) & ~s.stop,
                               functools.partial(advance, params, context, key), state)
    return state.argmax, o.denoising_steps - state.step

  return jax.jit(denoise)


def initial_canvas(cfg: Config, canvas_key) -> jax.Array:
  """int32 [C]: uniform tokens (`EntropyBoundSampler.initialize_canvas`). Canvas i of a
  generation from `key` has canvas_key = fold_in(key, i)."""
  return jax.random.randint(jax.random.fold_in(canvas_key, 0), (cfg.objective.block_size,), 0,
                            cfg.model.vocab_size, jnp.int32)


def _sample_canvas(params, cfg: Config, prompt_T, key, max_new_tokens: int,
                   eos_ids: tuple[int, ...], use_cache: bool, stats: SampleStats) -> np.ndarray:
  """DiffusionGemma's canvas-by-canvas generation (module docstring)."""
  c = cfg.objective.block_size
  n_canvases = -(-max_new_tokens // c)
  denoise = _canvas_denoiser(_model_json(cfg, "sample"), use_cache)
  context = prompt_T[None]
  if use_cache:  # the context's rows are committed causally (blocks of one token), as AR's
    commit = _ar_extend(_model_json(cfg))
    cache = empty_cache(cfg.model, 1, prompt_T.size + n_canvases * c)
    cache, _ = commit(params, cache, context, np.ones_like(context), 0, 0)
  out = []
  for i in range(n_canvases):
    canvas_key = jax.random.fold_in(key, i)
    given = (cache, context.shape[1]) if use_cache else context
    tokens, steps = denoise(params, given, initial_canvas(cfg, canvas_key), canvas_key)
    tokens = np.asarray(tokens)
    stats.tokens, stats.forwards = stats.tokens + tokens.size, stats.forwards + int(steps)
    out.extend(tokens.tolist())
    if set(eos_ids) & set(out) or i + 1 == n_canvases:
      break
    if use_cache:
      cache, _ = commit(params, cache, tokens[None], np.ones_like(tokens[None]),
                        context.shape[1], 0)
      stats.commit_forwards += 1
    context = np.concatenate([context, tokens[None]], axis=1)
  return _until_eos(out, len(out), eos_ids)  # whole canvases, as transformers returns them


def _model_json(cfg: Config, *sections: str) -> str:
  """The config sections a compiled sampler depends on, as a cache key."""
  d = cfg.to_dict()
  return json.dumps({k: d[k] for k in ("model", "objective", *sections)}, sort_keys=True)


_AR_PROMPT_BUCKET = 16  # prompts are left-padded to a multiple: few shapes, few compiles


@functools.lru_cache(maxsize=8)
def _ar_extend(cfg_json: str) -> Callable:
  """(params, cache, tokens_1T, seg_1T, start, pad) -> (cache, logits [V] of the next token):
  appends T causal rows to the cache (an AR mask is block-causal with blocks of one token)."""
  cfg = Config.from_dict(json.loads(cfg_json))

  def extend(params, cache, tokens_1T, seg_1T, start, pad):
    model = merge(cfg, params)
    h, cache = _commit_rows(model, cache, tokens_1T, seg_1T, start, 1, cfg.model.attention_chunk,
                            pad)
    return cache, model.logits(h[:, -1])[0]

  return jax.jit(extend)


def _sample_ar(params, cfg: Config, prompt_T, key, max_new_tokens: int, temperature: float,
               use_cache: bool, eos_ids: tuple[int, ...], stats: SampleStats) -> np.ndarray:
  """Plain autoregressive decoding; `use_cache=False` re-runs the whole causal forward for
  every token (the reference the cache is tested against)."""
  from bdlm_jax.loss import ar_logits  # loss imports the strategies; sampling rarely needs them
  m = cfg.model
  tokens = prompt_T.tolist()
  if use_cache:
    extend = _ar_extend(_model_json(cfg))
    first = -(-prompt_T.size // _AR_PROMPT_BUCKET) * _AR_PROMPT_BUCKET
    cache = empty_cache(m, 1, first + max_new_tokens)
    pad = first - prompt_T.size
    padded = np.zeros((1, first), np.int32)
    padded[0, pad:] = prompt_T
    cache, logits = extend(params, cache, padded, (np.arange(first) >= pad)[None], 0, pad)
  for i in range(max_new_tokens):
    if not use_cache:
      logits = ar_logits(params, cfg, np.asarray(tokens)[None])[0, -1]
    token = int(_pick(logits[None], jax.random.fold_in(key, i), temperature)[0])
    tokens.append(token)
    stats.tokens, stats.forwards = stats.tokens + 1, stats.forwards + 1
    if token in eos_ids:
      break
    if use_cache and i + 1 < max_new_tokens:
      one = np.ones((1, 1), np.int32)
      cache, logits = extend(params, cache, one * token, one, first + i, pad)
  return np.asarray(tokens[prompt_T.size:], np.int32)


def given_prompt(cfg: Config) -> str:
  """mode=sample's prompt: `sample.prompt`, or the text of `sample.prompt_file`."""
  o = cfg.sample
  if bool(o.prompt) == bool(o.prompt_file):
    raise ConfigError("mode=sample needs exactly one of sample.prompt or sample.prompt_file, "
                      "e.g. --set sample.prompt='12+7='")
  if not o.prompt_file:
    return o.prompt
  with open(o.prompt_file, encoding="utf-8") as f:
    return f.read()


def checked_tokenizer(cfg: Config):
  """`data.tokenizer`, checked against the model's vocabulary and [MASK] id (none for `ar`)."""
  from bdlm_jax.data.pipeline import check_tokenizer  # the data package imports grain
  from bdlm_jax.data.tokenizers import make_tokenizer
  tokenizer = make_tokenizer(cfg.data)
  check_tokenizer(tokenizer, cfg.data, cfg.model.vocab_size, reserved_mask_id(cfg))
  return tokenizer


def sample_checkpoint(cfg: Config, workdir: str) -> tuple[int, str, str, SampleStats]:
  """mode=sample: (step, prompt, completion, what it cost) from checkpoint
  `sample.checkpoint_step` (-1: latest) of `workdir`, prompted by `sample.prompt` or the
  text of `sample.prompt_file`."""
  from bdlm_jax.checkpoint import restore_state
  from bdlm_jax.data.chat import make_template, prompt_text
  from bdlm_jax.data.sources import DataError
  from bdlm_jax.parallel.mesh import make_mesh
  o = cfg.sample
  prompt = given_prompt(cfg)
  tokenizer = checked_tokenizer(cfg)
  shown = prompt_text(prompt, make_template(cfg.data)) if cfg.data.format == "chat" else prompt
  try:
    prompt_ids = tokenizer.encode(shown)
  except DataError as e:  # text the tokenizer cannot hold
    given = (f"sample.prompt_file={o.prompt_file!r}" if o.prompt_file else
             f"sample.prompt={o.prompt!r}")
    raise ConfigError(f"{given}: {e}") from e
  step, state = restore_state(cfg, workdir, make_mesh(cfg), o.checkpoint_step)
  params = sampling_params(state.params)
  stats = SampleStats()
  tokens = sample(params, cfg, prompt_ids, jax.random.key(cfg.seed), stats=stats)  # stop_ids
  return step, shown, tokenizer.decode(tokens), stats
