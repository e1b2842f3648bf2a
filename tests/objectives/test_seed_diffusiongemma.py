"""Oracle tests: our `diffusiongemma` objective beside the seed's own code (Turbo-dLLM 0.1.6,
package `dllm_parallel`): its `DiffusionGemmaNativeObjectiveRuntime.corrupt`
(core/objectives/diffusiongemma.py), the step denominators of `DiffusionGemmaNativeTrainingTask`
(core/objectives/training.py `_native_accumulation_loss_denominators`) and the backbone's
native loss methods (core/models/backbones/nemotron/model.py `_native_decoder_loss`,
`_native_encoder_ar_loss`, `_native_apply_self_conditioning`, which
`forward_diffusiongemma_native` calls for DiffusionGemma).

Rows are ours as `data.pack=false` makes them (bdlm_jax/data/chat.py `align`, `chat_per_row`:
the prompt padded on the left to whole blocks, so the response starts a canvas); the seed's
row is the same conversation without that padding, its decoder canvases starting at the
response. The seed draws first; its draws (t's antithetic base, the replacement mask, the
random tokens, the self-conditioning choice) are fed to ours through `jax.random`, and both
losses read the same logits (the seed's head is the identity, so its hidden states are the
logits).

Not run: the seed's whole `forward_diffusiongemma_native`. Its packed model builds on CPU
around a tiny transformers 5.24 DiffusionGemma (given the attention modules an
`apply_rotary_pos_emb`, which the seed looks for in vain in 5.24's attention `forward`), but
its canvas attention (`replicated_block_denoising_attention_bshd`) raises "block-denoising
FlexAttention requires CUDA tensors" (core/attention/context_parallel_attention.py). The
model side is covered by tests/checkpoint/test_hf.py (our canvas logits against
transformers') and tests/objectives/test_diffusiongemma.py (our loss and gradients against
a canvas-by-canvas reference). Skipped where `dllm_parallel` or torch is not installed
(docs/tests.md)."""

import pathlib
import types

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dllm_parallel")

from dllm_parallel.core.data import DataBatch  # noqa: E402
from dllm_parallel.core.models.backbones.nemotron.model import (  # noqa: E402
    NemotronLabsDiffusionPackedBlockDiffusionModel as SeedModel)
from dllm_parallel.core.objectives.diffusiongemma import (  # noqa: E402
    DiffusionGemmaNativeObjectiveRuntime)
from dllm_parallel.core.objectives.runtime import TokenAccountingPolicy  # noqa: E402
from dllm_parallel.core.objectives.training import (  # noqa: E402
    _native_accumulation_loss_denominators)

from bdlm_jax import make_batch  # noqa: E402
from bdlm_jax.config import Config  # noqa: E402
from bdlm_jax.configure import replace  # noqa: E402
from bdlm_jax.data import chat  # noqa: E402
from bdlm_jax.kernels.mask import CLEAN, NOISY  # noqa: E402
from bdlm_jax.models.transformer import expected_embedding, head_logits  # noqa: E402
from bdlm_jax.objectives import diffusiongemma  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
V, B, PAD_ID = 32, 4, 0
ENCODER_WEIGHT = 0.7  # not the recipe's 1.0, so that a missing factor shows


def _cfg(seq_len: int, antithetic: bool = True):
  return replace(Config(), model=dict(vocab_size=V, self_conditioning=True),
                 data=dict(seq_len=seq_len),
                 objective=dict(name=diffusiongemma.NAME, block_size=B, loss_weight="unit",
                                self_condition_p=0.5, encoder_loss_weight=ENCODER_WEIGHT,
                                antithetic=antithetic))


def _conversations(lengths, seed=0):
  """[(prompt ids, response ids)] of the given (prompt, response) lengths."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(1, V, p).astype(np.int32), rng.integers(1, V, r).astype(np.int32))
          for p, r in lengths]


def _our_rows(convs, seq_len):
  """(tokens, segment ids, protected) [S, L]: one conversation a row, data.pack=false."""
  examples = [chat.align(PAD_ID, B, seq_len, {"tokens": np.concatenate([p, r]),
                                               "scored": np.arange(len(p) + len(r)) >= len(p)})
              for p, r in convs]
  rows = list(chat.chat_per_row(grain.MapDataset.source(examples).to_iter_dataset(),
                                seq_len=seq_len, pad_id=PAD_ID))
  return tuple(np.stack([row[k] for row in rows])
               for k in ("tokens", "segment_ids", "protected"))


def _seed_batch(convs):
  """The seed's DataBatch of same-layout conversations: prompt + response, then padding to
  whole blocks (a valid prefix, a supervised suffix, one shared response start)."""
  prompt, response = len(convs[0][0]), len(convs[0][1])
  assert all((len(p), len(r)) == (prompt, response) for p, r in convs)
  n = prompt + response
  length = -(-n // B) * B
  ids = torch.zeros((len(convs), length), dtype=torch.long)
  for i, (p, r) in enumerate(convs):
    ids[i, :n] = torch.as_tensor(np.concatenate([p, r]))
  at = torch.arange(length)[None].expand(len(convs), -1)
  return DataBatch(input_ids=ids, loss_mask=(at >= prompt) & (at < n), valid_mask=at < n,
                   response_starts=torch.full((len(convs),), prompt))


def _seed_corrupt(batch, seed, antithetic=True):
  accounting = TokenAccountingPolicy(
      global_batch_size=1, micro_batch_size=1, gradient_accumulation_steps=1,
      data_parallel_size=1, context_parallel_size=1, block_parallel_size=1,
      tensor_parallel_size=1, sequence_parallel=False)
  runtime = DiffusionGemmaNativeObjectiveRuntime(
      block_size=B, seq_len=batch.input_ids.shape[1], vocab_size=V,
      device=torch.device("cpu"), seed=seed, token_accounting=accounting,
      sampling_epsilon_min=1e-3, sampling_epsilon_max=1.0, self_conditioning_probability=0.5,
      antithetic_sampling=antithetic)
  return runtime.corrupt(batch.input_ids, supervision_mask=batch.loss_mask,
                         valid_mask=batch.valid_mask, response_starts=batch.response_starts)


class _SeedLoss:
  """What the seed's native loss methods read of their model: an identity output head (its
  hidden states are the logits), no soft cap, one rank."""
  _native_decoder_loss = SeedModel._native_decoder_loss
  _native_encoder_ar_loss = SeedModel._native_encoder_ar_loss
  _native_token_cross_entropy = SeedModel._native_token_cross_entropy
  _native_active_loss_scale = SeedModel._native_active_loss_scale
  _native_apply_self_conditioning = SeedModel._native_apply_self_conditioning

  def __init__(self, weight=None, softcap=None, embedding_scale=1.0):
    self.block_size = B
    self.output_multiplier = None
    self.final_logit_softcap = softcap
    self.soft_embedding_scale = embedding_scale
    weight = torch.eye(V) if weight is None else weight
    self.output_head = torch.nn.Linear(weight.shape[1], V, bias=False)
    with torch.no_grad():
      self.output_head.weight.copy_(weight)
    self.runtime = types.SimpleNamespace(enabled=False, block_parallel_size=1,
                                         context_attention_size=1, tensor_parallel_size=1)
    self.self_conditioning = lambda canvas, soft: soft  # returns what it is given

  def losses(self, corrupted, decoder_logits, clean_logits, denominators):
    """(decoder loss, encoder loss) of one micro-batch, as forward_diffusiongemma_native."""
    dec = self._native_decoder_loss(
        torch.as_tensor(decoder_logits), corrupted.labels,
        torch.arange(corrupted.labels.shape[1]), corrupted.block_token_counts,
        corrupted.valid_block_mask, loss_denominator=denominators[0])
    enc = self._native_encoder_ar_loss(
        torch.as_tensor(clean_logits), corrupted.clean_input_ids,
        torch.arange(corrupted.clean_input_ids.shape[1]),
        encoder_valid_mask=corrupted.encoder_valid_mask, loss_denominator=denominators[1])
    return float(dec.detach()), float(enc.detach())


def _rows_at(batch, stream):
  """[S, L] the row index of (stream, position) (-1: none)."""
  s, r = batch.stream.shape
  out = -np.ones((s, r), np.int64)
  for i in range(s):
    at = np.flatnonzero(batch.stream[i] == stream)
    out[i, batch.pos[i, at]] = at
  return out[:, :batch.stream.shape[1] // 2]


class _Injected:
  """Feeds the seed's draws to our `corrupt` through `jax.random` (monkeypatched): the
  antithetic base of t (or, `base` an array [S, N], the uniforms of t), u = 0 where the seed
  replaced a token and 1 elsewhere (u < t, as t < 1), the seed's random tokens there, and
  each row's self-conditioning choice for every conversation number of the row."""

  def __init__(self, base, replaced_SL, tokens_SL, conditioned_S):
    self.base, self.replaced, self.tokens = base, replaced_SL, tokens_SL
    self.conditioned = conditioned_S

  def patch(self, monkeypatch):
    monkeypatch.setattr(jax.random, "uniform", self.fake_uniform)
    monkeypatch.setattr(jax.random, "randint", self.fake_randint)

  def fake_uniform(self, key, shape=(), *args, **kwargs):
    shape = tuple(shape)
    if shape == np.shape(self.base):
      return jnp.asarray(self.base, jnp.float32)
    if shape == self.replaced.shape:
      return jnp.where(self.replaced, 0.0, 1.0)
    if shape == (self.replaced.shape[0], self.replaced.shape[1] + 1):
      return jnp.broadcast_to(jnp.where(self.conditioned, 0.0, 1.0)[:, None], shape)
    raise AssertionError(f"an unexpected draw of shape {shape}")

  def fake_randint(self, key, shape, *args, **kwargs):
    assert tuple(shape) == self.replaced.shape, shape
    return jnp.asarray(self.tokens)


def _inject(convs, seq_len, corrupted_list, rows):
  """Each row's response start in our layout, and the draws (replaced [S, L], random tokens
  [S, L], self-conditioning [S]) of the seed's corrupted micro-batches in our positions;
  `rows`: (our row, seed micro-batch, its row)."""
  s = len(convs)
  replaced, tokens = np.zeros((s, seq_len), bool), np.zeros((s, seq_len), np.int32)
  conditioned = np.zeros(s, bool)
  starts = []
  for (i, c, j) in rows:  # our row i is the seed micro-batch c's row j
    prompt, response = len(convs[i][0]), len(convs[i][1])
    start = -(-prompt // B) * B  # our response start (prompt padded on the left)
    starts.append(start)
    corrupted = corrupted_list[c]
    mask = corrupted.replacement_mask[j, :response].numpy()
    replaced[i, start:start + response] = mask
    tokens[i, start:start + response] = corrupted.noisy_input_ids[j, :response].numpy()
    conditioned[i] = bool(corrupted.self_conditioning_mask[j])
  return starts, replaced, tokens, conditioned


def _logits_for(batch, convs, starts, rng):
  """Our logits [S, R, V] (random), and per seed row the decoder logits [dec, V] (offset d:
  our noisy row at response start + d) and clean logits [L_seed, V] (seed position q: our
  clean row at q + the left padding)."""
  s, r = batch.stream.shape
  logits = rng.normal(0, 2, (s, r, V)).astype(np.float32)
  noisy_at, clean_at = _rows_at(batch, NOISY), _rows_at(batch, CLEAN)
  decoder, clean = [], []
  for i, (p, resp) in enumerate(convs):
    left, start = -len(p) % B, starts[i]
    dec_len = -(-len(resp) // B) * B
    seed_len = -(-(len(p) + len(resp)) // B) * B
    d = np.zeros((dec_len, V), np.float32)
    n = min(dec_len, batch.stream.shape[1] // 2 - start)
    d[:n] = logits[i, noisy_at[i, start:start + n]]
    c = np.zeros((seed_len, V), np.float32)
    m = min(seed_len, batch.stream.shape[1] // 2 - left)
    c[:m] = logits[i, clean_at[i, left:left + m]]
    decoder.append(d)
    clean.append(c)
  return logits, decoder, clean


def _our_losses(batch, logits, scored, weights, cfg):
  score = lambda rows: float(diffusiongemma.score(
      jnp.asarray(logits), batch.labels, scored & rows, weights, cfg.objective))
  return score(batch.stream == NOISY), score(batch.stream == CLEAN) / ENCODER_WEIGHT


@pytest.mark.parametrize("antithetic", [True, False])
def test_one_batch_t_corruption_weights_and_losses_equal_the_seed_s(monkeypatch, antithetic):
  """Two rows of one layout (the seed's rule: a shared response start and valid length;
  prompt 5, response 11 over canvases of 4, so the last canvas is partial), our rows padded
  past the last block: the seed's t per canvas (antithetic over the response blocks, or
  independent), its corrupted canvas tokens, its labels, and given the same logits its
  decoder and encoder losses."""
  convs = _conversations([(5, 11), (5, 11)])
  seq_len = 28  # our rows: 3 + 5 prompt, 11 + 1 response, 8 padding
  cfg = _cfg(seq_len, antithetic)
  tokens, seg, protected = _our_rows(convs, seq_len)
  batch = make_batch(cfg, tokens, seg, protected)
  seed_batch = _seed_batch(convs)
  corrupted = _seed_corrupt(seed_batch, seed=4, antithetic=antithetic)
  assert corrupted.self_conditioning_mask.tolist() in ([True, False], [False, True])
  o = cfg.objective
  uniforms = (corrupted.diffusion_times.numpy() - o.eps_min) / (o.eps_max - o.eps_min)
  if antithetic:
    base = uniforms[0, 0]
  else:  # the seed's uniforms at our response blocks 2, 3, 4 of 7
    base = np.full((2, seq_len // B), 0.5, np.float32)
    base[:, 2:5] = uniforms
  starts, replaced, rand, conditioned = _inject(convs, seq_len, [corrupted],
                                                [(0, 0, 0), (1, 0, 1)])
  _Injected(base, replaced, rand, conditioned).patch(monkeypatch)
  key = jax.random.key(0)

  # t: antithetic over the batch's response blocks in (row, block) order, as the seed's
  t_SN, _ = diffusiongemma.response_noise(key, batch, cfg)
  ours_t = np.asarray(t_SN)[:, starts[0] // B:starts[0] // B + 3]
  np.testing.assert_allclose(ours_t, corrupted.diffusion_times.numpy(), atol=1e-6)

  _, (inputs, conditioned_SR), scored, weights = diffusiongemma.corrupt(key, batch, cfg)
  inputs, noisy_at = np.asarray(inputs), _rows_at(batch, NOISY)
  for i in range(2):
    rows = noisy_at[i, starts[i]:starts[i] + 11]
    np.testing.assert_array_equal(inputs[i, rows], corrupted.noisy_input_ids[i, :11])
    np.testing.assert_array_equal(batch.labels[i, rows], corrupted.labels[i, :11])
    # no other noisy row is scored; the seed's padded canvas offsets are not either
    others = np.setdiff1d(np.flatnonzero(batch.stream[i] == NOISY), rows)
    assert not np.asarray(scored)[i, others].any()
    assert (corrupted.labels[i, 11:] == -100).all()
    # the self-conditioning choice is the row's (one conversation a row)
    assert np.asarray(conditioned_SR)[i, rows].tolist() == [conditioned[i]] * 11

  logits, decoder, clean = _logits_for(batch, convs, starts, np.random.default_rng(1))
  denominators = _native_accumulation_loss_denominators(
      [seed_batch], runtime=types.SimpleNamespace(data_parallel_size=1,
                                                  expert_parallel_size=1))
  assert denominators.tolist() == [2.0, 30.0]  # rows with a response; 2 x 15 pairs
  seed_dec, seed_enc = _SeedLoss().losses(corrupted, np.stack(decoder), np.stack(clean),
                                          denominators)
  dec, enc = _our_losses(batch, logits, np.asarray(scored), weights, cfg)
  np.testing.assert_allclose([dec, enc], [seed_dec, seed_enc], rtol=2e-6)


def test_per_row_layouts_accumulated_like_the_seed_s_micro_batches(monkeypatch):
  """The recipe's one conversation a micro-batch (batch_size 1): three conversations of
  different prompt and response lengths are the seed's three micro-batches of one step
  (`_native_accumulation_loss_denominators` over all three, each micro-batch's loss / 3, as
  the seed's trainer backpropagates) and our one batch of three rows; the step's loss is
  the same."""
  convs = _conversations([(5, 11), (2, 6), (8, 3)], seed=3)
  seq_len = 24
  cfg = _cfg(seq_len)
  tokens, seg, protected = _our_rows(convs, seq_len)
  batch = make_batch(cfg, tokens, seg, protected)
  seed_batches = [_seed_batch([c]) for c in convs]
  corrupted = [_seed_corrupt(b, seed=10 + i) for i, b in enumerate(seed_batches)]
  starts, replaced, rand, conditioned = _inject(convs, seq_len, corrupted,
                                                [(i, i, 0) for i in range(3)])
  _Injected(0.25, replaced, rand, conditioned).patch(monkeypatch)
  _, (inputs, _), scored, weights = diffusiongemma.corrupt(jax.random.key(0), batch, cfg)
  logits, decoder, clean = _logits_for(batch, convs, starts, np.random.default_rng(2))
  denominators = _native_accumulation_loss_denominators(
      seed_batches, runtime=types.SimpleNamespace(data_parallel_size=1,
                                                  expert_parallel_size=1))
  seed = np.array([_SeedLoss().losses(c, d[None], q[None], denominators)
                   for c, d, q in zip(corrupted, decoder, clean)])
  seed_dec, seed_enc = seed.sum(0) / len(convs)  # loss * weight / weight sum, per micro-batch
  dec, enc = _our_losses(batch, logits, np.asarray(scored), weights, cfg)
  np.testing.assert_allclose([dec, enc], [seed_dec, seed_enc], rtol=2e-6)
  # accumulated over micro-batches of one row, with the step's counts, it is the same
  counts = diffusiongemma.step_counts(batch)
  total = 0.0
  for i in range(3):
    part = make_batch(cfg, tokens[i:i + 1], seg[i:i + 1], protected[i:i + 1])
    w = diffusiongemma.loss_weights(part, cfg, counts)
    total += float(diffusiongemma.score(jnp.asarray(logits[i:i + 1]), part.labels,
                                        part.labels >= 0, w, cfg.objective))
  np.testing.assert_allclose(total, dec + ENCODER_WEIGHT * enc, rtol=2e-6)


def test_encoder_pairs_of_the_last_block_are_the_one_difference(monkeypatch):
  """A conversation that reaches into our row's last block: the seed's encoder loss counts
  the pairs whose first token lies there, ours leaves them out (docs/diffusiongemma.md, "Choices of
  ours"). Ours equals the seed's own encoder loss over the valid prefix that ends one past
  our last block's start; the decoder loss is unchanged."""
  convs = _conversations([(5, 11)], seed=4)
  seq_len = 20  # 3 + 5 prompt, 11 + 1 response: positions 16, 17, 18 real in the last block
  cfg = _cfg(seq_len)
  tokens, seg, protected = _our_rows(convs, seq_len)
  batch = make_batch(cfg, tokens, seg, protected)
  seed_batch = _seed_batch(convs)
  corrupted = _seed_corrupt(seed_batch, seed=6)
  starts, replaced, rand, conditioned = _inject(convs, seq_len, [corrupted], [(0, 0, 0)])
  _Injected(0.5, replaced, rand, conditioned).patch(monkeypatch)
  _, _, scored, weights = diffusiongemma.corrupt(jax.random.key(0), batch, cfg)
  logits, decoder, clean = _logits_for(batch, convs, starts, np.random.default_rng(3))
  runtime = types.SimpleNamespace(data_parallel_size=1, expert_parallel_size=1)
  seed = _SeedLoss()
  full = seed.losses(corrupted, decoder[0][None], clean[0][None],
                     _native_accumulation_loss_denominators([seed_batch], runtime=runtime))
  dec, enc = _our_losses(batch, logits, np.asarray(scored), weights, cfg)
  np.testing.assert_allclose(dec, full[0], rtol=2e-6)
  assert abs(enc - full[1]) > 1e-3  # 2 of 15 pairs left out
  # the seed's encoder loss over the prefix ending at seed position 16 - 3 (our last block's
  # first position, less the left padding), + 1: pairs whose first token is before it
  prefix = torch.arange(16)[None] < 16 - 3 + 1
  cut = DataBatch(input_ids=seed_batch.input_ids, loss_mask=seed_batch.loss_mask & prefix,
                  valid_mask=prefix)
  denominators = _native_accumulation_loss_denominators([cut], runtime=runtime)
  assert denominators.tolist() == [1.0, 13.0]
  want = seed._native_encoder_ar_loss(
      torch.as_tensor(clean[0][None]), seed_batch.input_ids, torch.arange(16),
      encoder_valid_mask=prefix, loss_denominator=denominators[1])
  np.testing.assert_allclose(enc, float(want.detach()), rtol=2e-6)


def test_self_conditioning_soft_embeddings_equal_the_seed_s():
  """Given the same first-pass hidden states, tied table and soft cap (30): the seed's
  `_native_apply_self_conditioning` (`streaming_soft_embedding`, no gradient, scaled by
  sqrt(d_model)) on the selected rows and zeros on the others equals ours:
  `expected_embedding(head_logits(...))` times the row's draw, as `diffusiongemma.hidden`."""
  from flax import nnx
  d, s, n = 16, 3, 8
  rng = np.random.default_rng(7)
  table = rng.normal(0, 1, (V, d)).astype(np.float32)
  hidden = rng.normal(0, 2, (s, n, d)).astype(np.float32)
  selected = np.array([True, False, True])
  seed = _SeedLoss(weight=torch.as_tensor(table), softcap=30.0, embedding_scale=d ** 0.5)
  want = seed._native_apply_self_conditioning(
      torch.zeros((s, n, d)), torch.as_tensor(hidden), torch.as_tensor(selected),
      row_chunk_size=5, vocab_chunk_size=7).numpy()
  embed = nnx.Embed(V, d, rngs=nnx.Rngs(0))
  embed.embedding[...] = jnp.asarray(table)
  soft = expected_embedding(embed, head_logits(embed, jnp.asarray(hidden), 30.0), True)
  got = np.asarray(jax.lax.stop_gradient(soft) * selected[:, None, None])
  assert not want[1].any() and want[0].any()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
