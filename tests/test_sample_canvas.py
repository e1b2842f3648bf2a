"""DiffusionGemma's canvas sampler: one denoising step equals transformers' `_denoising_step`,
the acceptance and stopping rules on hand-made entropies, and `sample` end to end."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import import_hf, init_params, sample
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.sample import (canvas_temperature, denoising_step, entropy_bound_accepts,
                             initial_canvas, stable_and_confident, token_entropy)
from tests.checkpoint.test_hf import GEMMA4_TEXT, TINY_VISION
from tests.models.test_gemma4 import GEMMA4

CANVAS = 8  # the transformers model's canvas_length
TOL = 1e-5


@pytest.fixture(scope="module")
def diffusion_gemma(tmp_path_factory):
  """(torch model, cfg, params): a random DiffusionGemma of 3 layers (local, local, global),
  weights drawn as tests/checkpoint/test_hf.py's `gemma4_model` draws them, imported."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.DiffusionGemmaConfig(text_config={**GEMMA4_TEXT, "num_hidden_layers": 3},
                                             vision_config=TINY_VISION, canvas_length=CANVAS)
  model = transformers.DiffusionGemmaForBlockDiffusion._from_config(
      config, attn_implementation="eager").eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      center = (0.35 if "q_norm" in name or "k_norm" in name else
                1.0 if name.endswith(("norm.weight", "scale")) else 0.0)
      p.copy_(center + (0.5 if "router.proj" in name else 0.15) * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp("diffusion_gemma"))
  model.save_pretrained(folder)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the vision tower is left out
    cfg, params = import_hf(folder)
  assert (cfg.objective.name, cfg.objective.block_size) == ("diffusiongemma", CANVAS)
  return model, cfg, params


def hf_denoising_step(model, prompt_1T, canvas_C, self_conditioning_CV, step: int, steps: int,
                      t_min: float, t_max: float, entropy_bound: float):
  """transformers' step `step` of `steps` over a DynamicCache the encoder filled with the
  prompt, as `generate` prepares it: (sampler, argmax canvas [C], processed logits [C, V],
  stop). The sampler keeps its `accepted_token_mask` and the canvas it accepted."""
  import torch
  from transformers import DynamicCache, LogitsProcessorList
  from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf

  class RecordingSampler(hf.EntropyBoundSampler):
    def accept_canvas(self, *args):
      self.accepted = super().accept_canvas(*args)
      return self.accepted

  t, c = prompt_1T.shape[1], canvas_C.shape[0]
  ids = torch.as_tensor(prompt_1T)
  sampler = RecordingSampler(hf.EntropyBoundSamplerConfig(entropy_bound=float(entropy_bound)),
                             c, model.config.text_config.vocab_size, steps)
  with torch.no_grad():
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    pos = torch.arange(t, dtype=torch.int32)[None]
    unprocessed, masks = model._prepare_encoder_inputs(
        input_ids=ids, attention_mask=torch.ones((1, t), dtype=torch.bool),
        encoder_position_ids=pos, cache=cache, is_prefill=True, canvas_length=c, batch_size=1)
    cache = model.model.encoder(input_ids=unprocessed, attention_mask=masks, cache=cache,
                                position_ids=pos).cache
    canvas, given, mask_mapping, finished = model._prepare_denoiser_inputs(
        decoder_attention_mask=torch.ones((1, t + c), dtype=torch.bool), cache=cache,
        sampler=sampler, diffusion_stopping_criteria=None, batch_size=1, device=ids.device,
        model_kwargs=dict(decoder_input_ids=torch.as_tensor(canvas_C[None]),
                          self_conditioning_logits=torch.as_tensor(self_conditioning_CV[None])))
    _, argmax, processed, stop = model._denoising_step(
        decoder_forward=model.forward, current_canvas=canvas, argmax_canvas=canvas,
        input_ids=ids, decoder_position_ids=torch.arange(t, t + c, dtype=torch.int32)[None],
        self_conditioning_logits=given, mask_mapping=mask_mapping, cache=cache,
        finished_denoising=finished, cur_step=step, sampler=sampler,
        logits_processor=LogitsProcessorList(
            [hf.LinearTemperatureScheduleLogitsProcessor(t_min, t_max, steps)]),
        diffusion_stopping_criteria=hf.StableAndConfidentStoppingCriteria(1, 0.005))
  return sampler, argmax[0].numpy(), processed[0].float().numpy(), bool(stop[0])


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [False, True], ids=["default_schedule", "greedy"])
def test_a_denoising_step_equals_transformers(diffusion_gemma, greedy):
  """Step 5 of 8 from the same canvas, prompt (longer than the window) and self-conditioning
  logits: the same processed logits, argmax canvas, accepted positions and stop. Under the
  default schedule the denoiser's draw is random, so the bound is set to accept 4 of the 8
  positions; at t = 1e-4 every draw is the argmax and the accepted canvases are compared."""
  model, cfg, params = diffusion_gemma
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 64, (1, 13)).astype(np.int32)
  canvas = rng.integers(0, 64, CANVAS).astype(np.int32)
  given = 3 * rng.normal(size=(CANVAS, 64)).astype(np.float32)
  step, steps = 5, 8
  cfg = replace(cfg, sample=dict(denoising_steps=steps, **(dict(t_min=1e-4, t_max=1e-4)
                                                            if greedy else {})))
  o = cfg.sample
  ours = jax.jit(lambda p, c, g: denoising_step(p, cfg, prompt, c, g, step, jax.random.key(0)))(
      params, canvas, given)
  entropy = np.sort(np.asarray(ours.entropy))
  bound = o.entropy_bound if greedy else float(np.cumsum(entropy)[2:4].mean())
  sampler, argmax, processed, stop = hf_denoising_step(model, prompt, canvas, given, step, steps,
                                                       o.t_min, o.t_max, bound)
  t = float(canvas_temperature(o, step))
  assert abs(t - (o.t_min + (o.t_max - o.t_min) * step / steps)) < 1e-7
  err = np.abs(np.asarray(ours.logits) - processed).max() * t  # in units of the raw logits
  assert err < TOL, f"max abs logit error {err}"
  np.testing.assert_array_equal(ours.argmax, argmax)
  accepts = np.asarray(entropy_bound_accepts(ours.entropy, bound))
  np.testing.assert_array_equal(accepts, sampler.accepted_token_mask[0].numpy())
  history = np.full((1, CANVAS), -1, np.int32)
  assert bool(stable_and_confident(history, ours.argmax, ours.entropy, 0.005)[0]) == stop
  if greedy:
    assert accepts.all()  # entropies ~0
    np.testing.assert_array_equal(ours.accepted, sampler.accepted[0].numpy())
    np.testing.assert_array_equal(ours.canvas, ours.accepted)
  else:
    assert accepts.sum() == 4
    np.testing.assert_array_equal(np.asarray(ours.accepted)[~accepts], canvas[~accepts])


@pytest.mark.slow
@pytest.mark.parametrize("stability", [1, 7], ids=["stops_early", "all_steps"])
def test_a_canvas_equals_transformers_generate_from_the_same_start(diffusion_gemma, stability):
  """One canvas of `sample` against `model.generate` started on the same canvas, at t ~ 1e-4
  (every draw is the argmax, so the re-noising never shows): the chain of self-conditioned
  steps, the stopping rule (stability 7 > the 6 steps: it never stops early) and the argmax
  canvas kept."""
  import torch
  from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf
  model, cfg, params = diffusion_gemma
  options = dict(t_min=1e-4, t_max=2e-4, stability_threshold=stability)
  cfg = replace(cfg, sample=dict(denoising_steps=6, **options))
  prompt = np.random.default_rng(1).integers(0, 64, 13).astype(np.int32)
  key = jax.random.key(3)
  ours = sample(params, cfg, prompt, key, max_new_tokens=CANVAS, eos_id=-1)
  start = np.array(initial_canvas(cfg, jax.random.fold_in(key, 0)))
  with torch.no_grad():
    theirs = model.generate(
        torch.as_tensor(prompt[None]), decoder_input_ids=torch.as_tensor(start[None]),
        max_new_tokens=CANVAS, max_denoising_steps=6, eos_token_id=None,
        sampler_config=hf.EntropyBoundSamplerConfig(entropy_bound=0.1),
        confidence_threshold=0.005, return_dict_in_generate=False, **options)
  np.testing.assert_array_equal(ours, theirs[0, prompt.size:].numpy())


@pytest.mark.slow
def test_two_canvases_with_renoising_equal_transformers_generate_on_the_same_draws(
    diffusion_gemma, monkeypatch):
  """Two canvases at the default temperatures (0.4..0.8: draws are random and the tokens a
  step does not accept are re-noised) against `model.generate`, whose random draws replay
  ours: the denoiser's multinomial draw is our categorical draw of the same processed
  logits, each canvas starts from our `initial_canvas`, and re-noising uses our noise, all
  from `fold_in(fold_in(key, canvas), step)` as `sample` draws them. The output, the
  self-conditioning chain and the stopping rule must then agree token for token; and the
  chain re-noised tokens on the way (it is not the greedy case)."""
  import torch
  from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf
  model, cfg, params = diffusion_gemma
  cfg = replace(cfg, sample=dict(denoising_steps=6))
  prompt = np.random.default_rng(2).integers(0, 64, 13).astype(np.int32)
  key = jax.random.key(4)
  ours = sample(params, cfg, prompt, key, max_new_tokens=2 * CANVAS, eos_id=-1)
  # (transformers draws an initial canvas for the first one too, and drops it for ours)
  state = dict(canvas=-1, step=cfg.sample.denoising_steps, renoised=0)
  step_keys = lambda: jax.random.split(
      jax.random.fold_in(jax.random.fold_in(key, state["canvas"]), state["step"]))

  def multinomial(probs, num_samples):
    draw = jax.random.categorical(step_keys()[0], jnp.log(jnp.asarray(probs.numpy())))
    return torch.as_tensor(np.asarray(draw)[:, None], dtype=torch.long)

  def renoise(self, accepted, cur_step):
    noise = jax.random.randint(step_keys()[1], (CANVAS,), 0, cfg.model.vocab_size, jnp.int32)
    state["renoised"] += int((~self.accepted_token_mask).sum())
    state["step"] -= 1
    return torch.where(~self.accepted_token_mask, torch.as_tensor(np.array(noise))[None],
                       accepted)

  def initialize(self, batch_size, device):
    state.update(canvas=state["canvas"] + 1, step=cfg.sample.denoising_steps)
    return torch.as_tensor(np.array(
        initial_canvas(cfg, jax.random.fold_in(key, state["canvas"]))))[None].long()

  monkeypatch.setattr(torch, "multinomial", multinomial)
  monkeypatch.setattr(hf.EntropyBoundSampler, "renoise_canvas", renoise)
  monkeypatch.setattr(hf.EntropyBoundSampler, "initialize_canvas", initialize)
  start = np.array(initial_canvas(cfg, jax.random.fold_in(key, 0)))
  o = cfg.sample
  with torch.no_grad():
    theirs = model.generate(
        torch.as_tensor(prompt[None]), decoder_input_ids=torch.as_tensor(start[None]),
        max_new_tokens=2 * CANVAS, max_denoising_steps=o.denoising_steps, eos_token_id=None,
        sampler_config=hf.EntropyBoundSamplerConfig(entropy_bound=o.entropy_bound),
        t_min=o.t_min, t_max=o.t_max, stability_threshold=o.stability_threshold,
        confidence_threshold=o.confidence_threshold, return_dict_in_generate=False)
  assert state["canvas"] == 1 and state["renoised"] > 0
  np.testing.assert_array_equal(ours, theirs[0, prompt.size:].numpy())


def test_entropy_bound_acceptance_on_hand_made_entropies():
  """The k lowest entropies are taken while their sum less the largest stays within the
  bound: 0 + 0.04 + 0.05 = 0.09 admits the 0.3 (it is the largest), not the 1.0."""
  entropy = np.array([0.3, 0.0, 0.05, 0.04, 1.0], np.float32)
  for bound, want in [(0.1, [1, 1, 1, 1, 0]), (0.08, [0, 1, 1, 1, 0]), (0.5, [1, 1, 1, 1, 1]),
                      (0.035, [0, 1, 0, 1, 0])]:
    np.testing.assert_array_equal(entropy_bound_accepts(entropy, bound), np.array(want, bool),
                                  err_msg=f"bound {bound}")
  np.testing.assert_array_equal(entropy_bound_accepts(np.full(4, 2.0, np.float32), 0.1),
                                [True, False, False, False])  # the lowest always; ties by order


def test_token_entropy_of_known_distributions():
  logits = np.array([[0.0] * 8, [0.0, 0.0] + [-np.inf] * 6, [60.0] + [0.0] * 7], np.float32)
  np.testing.assert_allclose(token_entropy(logits), [np.log(8), np.log(2), 0.0], atol=1e-6)


def test_stable_and_confident_stopping_on_hand_made_canvases():
  """Stable: the argmax canvas equals each of the last `threshold` ones (none before the
  first step: -1); confident: mean entropy below the threshold."""
  a, b = np.array([3, 1, 4], np.int32), np.array([3, 1, 5], np.int32)
  low, high = np.full(3, 1e-3, np.float32), np.array([0.0, 0.0, 0.03], np.float32)  # mean 0.01

  def run(threshold, canvases, entropies):
    history, stops = np.full((threshold, 3), -1, np.int32), []
    for argmax, entropy in zip(canvases, entropies):
      stop, history = stable_and_confident(history, argmax, entropy, 0.005)
      stops.append(bool(stop))
    return stops

  assert run(1, [a, a, b, b, a], [low] * 5) == [False, True, False, True, False]
  assert run(2, [a, a, a, b, b, b], [low] * 6) == [False, False, True, False, False, True]
  assert run(0, [a, b], [low, low]) == [True, True]
  assert run(1, [a, a, a], [low, high, low]) == [False, False, True]


def test_acceptance_and_stopping_agree_with_the_classes_of_transformers():
  """On random logits (entropies spread over orders of magnitude) and runs of argmax canvases
  that repeat at random: `EntropyBoundSampler.accept_canvas`'s mask and
  `StableAndConfidentStoppingCriteria`'s verdicts, for stability thresholds 0, 1 and 2."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf
  rng = np.random.default_rng(2)
  steps, c, v = 12, 6, 16
  logits = (rng.normal(size=(steps, c, v)) * 10.0 ** rng.uniform(-1, 2, (steps, c, 1)))
  logits = logits.astype(np.float32)
  entropy = np.asarray(token_entropy(logits))
  canvases = rng.integers(0, 2, (steps, c)).astype(np.int32)
  canvases[rng.random(steps) < 0.6] = canvases[0]  # often the same canvas again
  confidence = float(np.median(entropy.mean(-1)))
  sampler = hf.EntropyBoundSampler(hf.EntropyBoundSamplerConfig(entropy_bound=0.5), c, v, steps)
  for n in range(steps):
    sampler.accept_canvas(torch.zeros((1, c), dtype=torch.long),
                          torch.ones((1, c), dtype=torch.long), torch.as_tensor(logits[n:n + 1]), 0)
    np.testing.assert_array_equal(entropy_bound_accepts(entropy[n], 0.5),
                                  sampler.accepted_token_mask[0].numpy())
  for threshold in (0, 1, 2):
    criteria = hf.StableAndConfidentStoppingCriteria(threshold, confidence)
    history, ours, theirs = np.full((threshold, c), -1, np.int32), [], []
    for n in range(steps):
      stop, history = stable_and_confident(history, canvases[n], entropy[n], confidence)
      ours.append(bool(stop))
      theirs.append(bool(criteria(torch.as_tensor(canvases[n:n + 1]),
                                  torch.as_tensor(logits[n:n + 1]))[0]))
    assert ours == theirs, f"stability threshold {threshold}"
    assert any(theirs) and not all(theirs)


@pytest.mark.parametrize("section, message", [
    (dict(t_min=0.9, t_max=0.5), r"sample.t_max=0.5 is below sample.t_min=0.9"),
    (dict(t_min=-0.1), r"sample.t_min must be >= 0"),
    (dict(t_min=0.0, t_max=0.0), r"sample.t_max must be > 0"),
    (dict(entropy_bound=0.0), r"sample.entropy_bound must be > 0"),
    (dict(denoising_steps=0), r"sample.denoising_steps must be >= 1"),
    (dict(stability_threshold=-1), r"sample.stability_threshold must be >= 0"),
    (dict(confidence_threshold=0.0), r"sample.confidence_threshold must be > 0"),
])
def test_bad_canvas_options_are_config_errors_naming_the_key(section, message):
  with pytest.raises(ConfigError, match=message):
    replace(Config(), sample=section)


@pytest.mark.slow
def test_sample_generates_canvases_deterministically_and_stops_after_eos():
  """A Gemma 4-shaped model of ours with self-conditioning, sampled with the KV cache; 6 tokens
  are 2 whole canvases of 4, as transformers returns them. Stopping at a token it generates
  gives the same tokens up to and including its first occurrence, and so does a list of EOS
  ids (the IT checkpoint's kind) holding it and ids never generated, or sample.eos_ids."""
  cfg = replace(Config(), model={**dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                                        d_ff=64), **GEMMA4, "self_conditioning": True},
                data=dict(seq_len=32), objective=dict(name="diffusiongemma", block_size=4, loss_weight="unit"),
                sample=dict(denoising_steps=6))
  params = init_params(cfg, jax.random.key(0))
  prompt = list(b"12+7=")
  free = sample(params, cfg, prompt, jax.random.key(1), max_new_tokens=6, eos_id=-1)
  assert free.shape == (8,) and free.dtype == np.int32
  assert 0 <= free.min() and free.max() < cfg.model.vocab_size
  np.testing.assert_array_equal(sample(params, cfg, prompt, jax.random.key(1),
                                       max_new_tokens=6, eos_id=-1), free)
  eos = int(free[5])
  first = list(free).index(eos)
  stopped = sample(params, cfg, prompt, jax.random.key(1), max_new_tokens=6, eos_id=eos)
  np.testing.assert_array_equal(stopped, free[:first + 1])
  never = [t for t in range(cfg.model.vocab_size) if t not in free][:2]
  listed = sample(params, cfg, prompt, jax.random.key(1), max_new_tokens=6,
                  eos_id=[never[0], eos, never[1]])
  np.testing.assert_array_equal(listed, free[:first + 1])
  configured = replace(cfg, sample=dict(eos_ids=f"{never[0]},{eos}"))
  np.testing.assert_array_equal(sample(params, configured, prompt, jax.random.key(1),
                                       max_new_tokens=6), free[:first + 1])


def _tiny_diffusion_gemma():
  """A Gemma 4-shaped DiffusionGemma of ours with self-conditioning, canvases of 4."""
  return replace(Config(), model={**dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                                         d_ff=64), **GEMMA4, "self_conditioning": True},
                 data=dict(seq_len=32), objective=dict(name="diffusiongemma", block_size=4,
                                                       loss_weight="unit"),
                 sample=dict(denoising_steps=6))


def test_a_canvas_over_the_cached_context_has_canvas_logits():
  """The context (7 tokens) committed causally to the KV cache, local and global layers' K/V
  in arrays of their own shapes; the canvas, self-conditioned, run over it: the logits of
  `canvas_logits`, which recomputes the context."""
  from bdlm_jax.loss import canvas_logits
  from bdlm_jax.sample import _ar_extend, _cached_canvas_logits, _model_json, empty_cache
  cfg = _tiny_diffusion_gemma()
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(6)
  context, canvas = rng.integers(0, 250, (1, 7)), rng.integers(0, 250, 4)
  given = jnp.asarray(rng.normal(size=(4, cfg.model.vocab_size)), jnp.float32)
  cache, _ = _ar_extend(_model_json(cfg))(params, empty_cache(cfg.model, 1, 11), context,
                                          np.ones_like(context), 0, 0)
  run = jax.jit(lambda *args: _cached_canvas_logits(params, cfg, *args))
  cached = run(cache, 7, canvas, given)
  np.testing.assert_allclose(cached, canvas_logits(params, cfg, context, canvas[None],
                                                   given[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_canvases_over_the_kv_cache_equal_recomputing_the_context():
  """Three canvases at the default temperatures (draws and re-noising) and near-greedy:
  token for token, with the cache (the context committed once a canvas) and without."""
  cfg = _tiny_diffusion_gemma()
  params = init_params(cfg, jax.random.key(0))
  for t_max in (0.8, 2e-4):
    tried = replace(cfg, sample=dict(t_min=t_max / 2, t_max=t_max))
    cached, full = (sample(params, tried, list(b"12+7="), jax.random.key(1), max_new_tokens=12,
                           eos_id=-1, use_cache=use_cache) for use_cache in (True, False))
    assert len(cached) == 12
    np.testing.assert_array_equal(cached, full)
