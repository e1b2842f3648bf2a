"""`loss_fn`: one pure, differentiable function of (params, batch, key) for every strategy.

The strategy only changes how attention is executed (`make_attend`) and the static row
slot where logits are computed; the corruption is drawn in logical coordinates, so the
same (params, batch, key) gives the same loss under every layout. `loss_fn` resolves the
config each call; the train step resolves it once (`bdlm_jax.spec`) and calls `spec_loss`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from bdlm_jax.batch import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.models.moe import router_losses
from bdlm_jax.kernels import with_windows, xla
from bdlm_jax.kernels.mask import CLEAN, NOISY, row_meta
from bdlm_jax.models.transformer import STACKS, expected_embedding, head_logits
from bdlm_jax.objectives import ar
from bdlm_jax.params import join, merge, split_frozen
from bdlm_jax.parallel import recurrence
from bdlm_jax.parallel.mesh import BATCH_AXES
from bdlm_jax.parallel.registry import SINGLE_DEVICE
from bdlm_jax.parallel.zero3 import gathered_weights
from bdlm_jax.spec import StepSpec, resolve


def _check_batch(cfg, batch, plan):
  rows = batch.tokens.shape[1]
  want = plan.num_ranks * plan.rows_per_rank
  if rows != want:
    raise ConfigError(f"batch has {rows} rows but strategy {cfg.parallel.strategy!r} with "
                      f"L={cfg.data.seq_len}, seq={plan.num_ranks} lays out {want}: build it "
                      f"with make_batch(cfg, ...) using the same config")


def chunked_loss(head, score_fn, chunk: int, softcap: float, h_SND, labels_SN, take_SN,
                 weight_SN, *teacher_SND, multiplier: float = 1.0):
  """`score_fn(logits, labels, take, weight, *teacher_logits)` summed over chunks of `chunk`
  rows; the logits are `head_logits(head, h, softcap, multiplier)`, and so are those of any
  `teacher` hidden states given (a drafter's target, for its KL loss).

  Only one chunk's float32 logits [S, chunk, vocab] exist at a time, never [rows, vocab]:
  the chunks run as a `lax.scan` whose body is rematerialised, so the backward recomputes
  each chunk's logits instead of saving them, and accumulates the head's gradient in its
  own dtype. `chunk <= 0` scores all rows at once.
  """
  s, n = h_SND.shape[:2]
  c = n if chunk <= 0 else min(chunk, n)
  k = -(-n // c)

  def split(x, pad_value):  # [S, n, ...] -> [k, S, c, ...]
    x = jnp.pad(x, [(0, 0), (0, k * c - n)] + [(0, 0)] * (x.ndim - 2), constant_values=pad_value)
    return jnp.moveaxis(x.reshape(s, k, c, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def body(total, xs):
    h, labels, take, weight, *teacher = xs
    logits = [head_logits(head, x, softcap, multiplier) for x in (h, *teacher)]
    return total + score_fn(logits[0], labels, take, weight, *logits[1:]), None

  xs = (split(h_SND, 0), split(labels_SN, -1), split(take_SN, False), split(weight_SN, 0),
        *(split(t, 0) for t in teacher_SND))
  total = jnp.zeros_like(weight_SN, shape=())  # zeros_like: varies over mesh axes as the rows
  return jax.lax.scan(body, total, xs)[0]


def _loss_on_every_device(head, score_fn, chunk: int, softcap: float, mesh, *rows,
                          multiplier: float = 1.0):
  """`chunked_loss` run by every device on the rows it holds, summed over the mesh.

  Under `shard_map` each device accumulates the head's gradient over its own chunks and the
  devices meet once, at the boundary, in one reduction of that gradient; left to GSPMD the
  loop would all-reduce it once per chunk.
  """
  if mesh is None or mesh.size == 1:  # (XLA keeps a one-device psum as an all-reduce)
    return chunked_loss(head, score_fn, chunk, softcap, *rows, multiplier=multiplier)
  graphdef, state = nnx.split(head)
  axes = tuple(mesh.axis_names)

  def local(state, *rows):
    # Varying from here on, so the transpose (the gradient's sum over devices) happens here,
    # once, and not inside the loop where each chunk would mark it varying again.
    state = jax.tree.map(lambda w: jax.lax.pcast(w, axes, to="varying"), state)
    total = chunked_loss(nnx.merge(graphdef, state), score_fn, chunk, softcap, *rows,
                         multiplier=multiplier)
    return jax.lax.psum(total, axes)

  row_specs = [P(BATCH_AXES, "seq", *[None] * (x.ndim - 2)) for x in rows]
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), *row_specs), out_specs=P())(state, *rows)


def _gathered_once(params, gather):
  """`params` with every weight outside the layer stacks through `gather`: the embedding,
  head and norms (and a drafter's fc) once per step; stacked layers are gathered one by one
  in their scan."""
  return {k: v if k in STACKS else _gathered_once(v, gather) if isinstance(v, dict)
          else gather(v) for k, v in params.items()}


def loss_fn(params, batch, key, cfg: Config, mesh=None):
  """(loss, metrics): weighted masked-token CE summed over the batch / the objective's
  `normalizer` (its valid tokens, for most), plus an MoE's weighted router losses (then the
  CE alone is `metrics["token_loss"]`).

  Frozen parameters (a drafter's target, `train.freeze`'s routers) get no gradient here,
  whatever the caller differentiates."""
  return spec_loss(resolve(cfg, mesh), params, batch, key)


def spec_loss(spec: StepSpec, params, batch, key, counts=None):
  """`loss_fn` of a config resolved once (`bdlm_jax.spec.resolve`): rows -> corrupt ->
  model -> score, whatever the objective and the strategy. `counts`: the objective's
  `step_counts` of the whole step when `batch` is one of its micro-batches."""
  cfg, mesh, plan, objective = spec.cfg, spec.mesh, spec.plan, spec.objective
  _check_batch(cfg, batch, plan)
  trainable, frozen = split_frozen(cfg, params)
  params = join(trainable, jax.lax.stop_gradient(frozen))
  # The embedding and head are gathered in param_dtype: the chunked loss accumulates the
  # head's gradient over many row chunks. Layers are cast to compute_dtype, then gathered,
  # and so is a frozen subtree's every weight (no gradient to accumulate).
  layer_weights = gathered_weights(mesh, jnp.dtype(cfg.model.compute_dtype),
                                   cfg.parallel.expert_axis_names)
  gathered = _gathered_once(params, gathered_weights(mesh))
  for frozen in objective.FROZEN:
    gathered[frozen] = _gathered_once(params[frozen], layer_weights)
  model = merge(cfg, gathered)
  batch = spec.rows_sharded(batch)
  n_valid = jnp.sum(batch.labels >= 0)  # before an objective adds copies of the batch
  normalizer = objective.normalizer(batch)
  counts = objective.step_counts(batch) if counts is None else counts
  batch, inputs, scored, weight = objective.corrupt(key, batch, cfg, counts)
  hidden, teacher, stats = objective.hidden(spec, model, batch, inputs, layer_weights)
  metrics = dict(valid_tokens=n_valid, masked_tokens=jnp.sum(scored & (batch.labels >= 0)))
  # An objective whose rows weigh each other (DFlash2's D-PACE, LK and selector losses) may
  # score them as a whole, (loss, metrics); else a score is summed over chunks of rows.
  whole = getattr(objective, "rows_loss", lambda *_: None)(spec, model, batch, hidden, scored,
                                                            weight)
  if whole is not None:
    loss, more = whole
    metrics.update(more)
  else:
    score = functools.partial(objective.score, cfg=cfg.objective)
    rows = [hidden] + [plan.slot_rows(x, objective.LOSS_SLOT)
                       for x in (batch.labels, scored, weight)] + list(teacher)
    total = _loss_on_every_device(model.head, score, cfg.model.logits_chunk,
                                  cfg.model.logit_softcap, mesh, *rows,
                                  multiplier=cfg.model.output_multiplier)
    loss = total / normalizer
  if cfg.model.moe_experts:
    router = router_losses(stats, cfg.model.moe_experts)
    metrics.update(router, token_loss=loss)
    # A micro-batch given the step's counts adds its valid tokens' share of router losses.
    share = n_valid / jnp.maximum(counts["labelled"], 1) if counts else 1.0
    loss = loss + share * (cfg.model.moe_aux_weight * router["moe_aux_loss"]
                           + cfg.model.moe_z_weight * router["moe_z_loss"])
  return loss, dict(metrics, loss=loss)


def ar_logits(params, cfg: Config, tokens, segment_ids=None) -> jax.Array:
  """Plain causal forward of logical tokens [S, L] -> float32 logits [S, L, vocab].

  `segment_ids` int [S, L] (None: each row one document): packed documents, 0 padding; each
  document's logits are its own run's (attention masked to it, Gated DeltaNet restarted at
  its first token). For interop and evaluation: the layout is built on the host, so `tokens`
  is concrete (jit the model inside, not this function over `tokens`: `ar_rows` then
  `ar_forward`, as likelihood.py does)."""
  return ar_forward(params, *ar_rows(cfg, tokens, segment_ids))


def ar_rows(cfg: Config, tokens, segment_ids=None):
  """(config, `Batch`) of `ar_logits`' forward: `cfg` as `ar` on one device at the tokens'
  length, and their rows, built on the host."""
  ar_cfg = replace(cfg, objective=dict(name=ar.NAME), parallel=dict(strategy=SINGLE_DEVICE, seq=1),
                   data=dict(seq_len=int(np.shape(tokens)[1])))
  return ar_cfg, make_batch(ar_cfg, np.asarray(tokens), segment_ids)


def ar_forward(params, ar_cfg: Config, batch) -> jax.Array:
  """float32 logits [S, L, vocab] of `ar_rows`' batch: jittable over (params, batch)."""
  model = merge(ar_cfg, params)
  hidden = model(batch.tokens, batch.pos, batch.meta, resolve(ar_cfg).attend["all"])
  return model.logits(hidden)


def canvas_logits(params, cfg: Config, prompt_tokens, canvas_tokens,
                  self_conditioning_logits=None) -> jax.Array:
  """A canvas's float32 logits [S, C, vocab], on one device: canvas tokens [S, C] read
  bidirectionally after the causal stream of `prompt_tokens` [S, T] (a local layer's canvas
  sees the prompt's last window - 1 tokens), at positions T..T+C-1, as DiffusionGemma's
  `DiffusionGemmaForBlockDiffusion(input_ids=prompt, decoder_input_ids=canvas,
  self_conditioning_logits=...)` computes them.

  A model with `model.self_conditioning` passes the canvas embeddings through it, conditioned
  on the soft embedding of `self_conditioning_logits` [S, C, vocab] (zeros without: the first
  denoising step), a constant to differentiation as in the seed's training (no gradient to
  the embedding table through it). The prompt need not fill whole blocks: it is one causal
  stream."""
  prompt, canvas = jnp.asarray(prompt_tokens), jnp.asarray(canvas_tokens)
  if prompt.ndim != 2 or canvas.ndim != 2 or prompt.shape[0] != canvas.shape[0]:
    raise ConfigError(f"canvas_logits needs prompt [S, T] and canvas [S, C] tokens, got shapes "
                      f"{prompt.shape} and {canvas.shape}")
  if self_conditioning_logits is not None and not cfg.model.self_conditioning:
    raise ConfigError("self_conditioning_logits need model.self_conditioning=true (the "
                      "self-conditioning module's weights)")
  (s, t), c = prompt.shape, canvas.shape[1]
  pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(t), t + jnp.arange(c)]), (s, t + c))
  # Blocks of one token: the prompt is causal, and the canvas is one block after all of it.
  meta = row_meta(jnp.where(pos < t, CLEAN, NOISY), jnp.minimum(pos, t), jnp.ones_like(pos), pos)
  attend = with_windows(functools.partial(xla.attend, chunk=cfg.model.attention_chunk), 1)
  attend.recur = recurrence.causal  # the canvas after its prompt: the concat reference itself
  model = merge(cfg, params)
  x = jnp.concatenate([model.embed_tokens(prompt),
                       canvas_embeddings(model, cfg, canvas, self_conditioning_logits)], axis=1)
  hidden, _ = model.over_layers(x, pos, meta, attend)
  return model.logits(hidden[:, t:])


def canvas_embeddings(model, cfg: Config, canvas_SC, self_conditioning_logits=None):
  """A canvas's first-layer input [S, C, D]: its embeddings, through the self-conditioning
  module with `model.self_conditioning` (on zeros when no logits are given)."""
  x = model.embed_tokens(canvas_SC)
  if not cfg.model.self_conditioning:
    return x
  soft = (jnp.zeros_like(x) if self_conditioning_logits is None else
          expected_embedding(model.embed, self_conditioning_logits,
                             cfg.model.scale_embeddings).astype(x.dtype))
  soft = jax.lax.stop_gradient(soft)  # a constant input, as the seed trains it
  return model.self_condition(x, soft)


def draft_logits(params, cfg: Config, tokens, segment_ids=None, protected=None, context=None):
  """A drafter's float32 logits at its draft rows, [S, A, B, vocab], and the `Batch` of its
  logical rows (`[draft ; context]`; draft row j*B + k is slot k of anchor j), on one device.

  For evaluation (acceptance length): the anchors are drawn from the tokens (`make_batch`
  without a key), the same every call. `tokens` are logical [S, L], concrete (the layout is
  built on the host); `context`: the target's features [S, L, K, D] where the drafter reads
  them precomputed (`drafter.features`)."""
  one = replace(cfg, parallel=dict(strategy=SINGLE_DEVICE, seq=1, data=1, fsdp=1))
  batch = make_batch(one, np.asarray(tokens), segment_ids, protected, context)
  spec = resolve(one)

  @jax.jit
  def run(params, batch):
    model = merge(one, params)
    batch, inputs, _, _ = spec.objective.corrupt(None, batch, one)
    hidden, _, _ = spec.objective.hidden(spec, model, batch, inputs, None)
    return head_logits(model.head, hidden, one.model.logit_softcap, one.model.output_multiplier)

  s, b = batch.tokens.shape[0], one.objective.block_size
  return run(params, batch).reshape(s, -1, b, one.model.vocab_size), batch
