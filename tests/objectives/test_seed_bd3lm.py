"""Oracle test: our `bd3lm` objective beside the seed's own code (Turbo-dLLM 0.1.6, package
`dllm_parallel`): `StandardBlockDiffusionTrainingTask` (core/objectives/training.py: its
`prepare`, the step denominator `_accumulation_loss_denominator`, and `loss`), which runs
`StandardBlockDiffusionObjectiveRuntime.corrupt` (core/objectives/runtime.py) and the
backbone's `distributed_block_diffusion_loss` (core/models/backbones/nemotron/model.py).

The seed draws first; its draws (t's antithetic base or its independent uniforms, and the
masked positions) are fed to ours through `jax.random`, and both losses read the same logits
(the seed's head is the identity, so its hidden states are the logits). Compared: t per
(sequence, block), the corrupted tokens, which rows are scored and their labels, the 1/t
weights, the denominator (supervised tokens) and the loss, with the [MASK] logit removed
from the softmax in both. Not run: the seed's model forward (the model side is ours alone).
Skipped where `dllm_parallel` or torch is not installed (docs/tests.md)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("dllm_parallel")
pytest.importorskip("yaml")  # the seed's package imports it (transformers needs it)

from dllm_parallel.core.data import DataBatch  # noqa: E402
from dllm_parallel.core.models.backbones.nemotron.model import (  # noqa: E402
    NemotronLabsDiffusionPackedBlockDiffusionModel as SeedModel)
from dllm_parallel.core.objectives.runtime import TokenAccountingPolicy  # noqa: E402
from dllm_parallel.core.objectives.training import (  # noqa: E402
    StandardBlockDiffusionTrainingTask)

from bdlm_jax import make_batch  # noqa: E402
from bdlm_jax.config import Config  # noqa: E402
from bdlm_jax.configure import replace  # noqa: E402
from bdlm_jax.kernels.mask import NOISY  # noqa: E402
from bdlm_jax.objectives import bd3lm  # noqa: E402
from bdlm_jax.objectives.base import count_labels  # noqa: E402

V, MASK, B, S, L = 32, 31, 4, 2, 16


class _SeedModel:
  """What the seed's `distributed_block_diffusion_loss` reads of its model: an identity
  output head (hidden states are logits), no soft cap, one rank."""
  distributed_block_diffusion_loss = SeedModel.distributed_block_diffusion_loss

  def __init__(self):
    self.block_size = B
    self.output_multiplier = None
    self.final_logit_softcap = None
    self.output_head = torch.nn.Linear(V, V, bias=False)
    with torch.no_grad():
      self.output_head.weight.copy_(torch.eye(V))
    self.runtime = types.SimpleNamespace(enabled=False)


def _seed_task(antithetic: bool, weighting: str, seed: int):
  accounting = TokenAccountingPolicy(
      global_batch_size=S, micro_batch_size=S, gradient_accumulation_steps=1,
      data_parallel_size=1, context_parallel_size=1, block_parallel_size=1,
      tensor_parallel_size=1, sequence_parallel=False)
  return StandardBlockDiffusionTrainingTask(
      mask_token_id=MASK, block_size=B, seq_len=L, vocab_size=V, device=torch.device("cpu"),
      seed=seed, runtime=types.SimpleNamespace(enabled=False, data_parallel_size=1,
                                               expert_parallel_size=1),
      token_accounting=accounting, noise_schedule="loglinear", loss_weighting=weighting,
      noise_schedule_epsilon=1e-3, sampling_epsilon_min=1e-3, sampling_epsilon_max=1.0,
      antithetic_sampling=antithetic, bp_loss_scale=None)


@pytest.mark.parametrize("antithetic", [True, False])
@pytest.mark.parametrize("weighting", ["inverse_move_chance", "unit"])
@pytest.mark.parametrize("prompt", [0, 5])
def test_corruption_weights_and_loss_equal_the_seed_s(monkeypatch, antithetic, weighting,
                                                      prompt):
  """Two rows of 4 blocks of 4, the first `prompt` tokens of each protected (the seed's
  supervision mask is the rest; 0: no mask, every token supervised)."""
  cfg = replace(Config(), model=dict(vocab_size=V), data=dict(seq_len=L),
                objective=dict(name=bd3lm.NAME, block_size=B, mask_token_id=MASK,
                               antithetic=antithetic,
                               loss_weight="inv_t" if weighting != "unit" else "unit"))
  rng = np.random.default_rng(prompt)
  tokens = rng.integers(0, MASK, (S, L)).astype(np.int32)
  protected = np.zeros((S, L), bool)
  protected[:, :prompt] = True
  ids = torch.as_tensor(tokens, dtype=torch.long)
  data = DataBatch(input_ids=ids, loss_mask=torch.as_tensor(~protected) if prompt else None)
  task = _seed_task(antithetic, weighting, seed=7)
  seed = task.prepare(data).corrupted
  masked_seed = (seed.labels != -100).numpy()
  assert masked_seed.any() and not masked_seed.all()

  uniforms = (seed.diffusion_times.numpy() - 1e-3) / (1.0 - 1e-3)
  base = np.float32(uniforms[0, 0]) if antithetic else uniforms.reshape(-1)
  real_uniform = jax.random.uniform

  def fake_uniform(key, shape=(), *args, **kwargs):
    shape = tuple(shape)
    if shape == np.shape(base):
      return jnp.asarray(base, jnp.float32)
    assert shape == (S, L), shape  # u per position: below t exactly where the seed masked
    return jnp.where(masked_seed, 0.0, 1.0)

  monkeypatch.setattr(jax.random, "uniform", fake_uniform)
  batch = make_batch(cfg, tokens, None, protected)
  key = jax.random.key(0)
  t_SN, _ = bd3lm.draw_noise(key, S, L, cfg.objective)
  np.testing.assert_allclose(np.asarray(t_SN), seed.diffusion_times.numpy(), rtol=1e-6)
  _, inputs, masked, weight = bd3lm.corrupt(key, batch, cfg)
  monkeypatch.setattr(jax.random, "uniform", real_uniform)

  noisy = batch.stream == NOISY
  at = np.argsort(np.where(noisy, batch.pos, L + batch.pos), axis=1)[:, :L]  # rows by position
  take = lambda x: np.take_along_axis(np.asarray(x), at, axis=1)
  np.testing.assert_array_equal(take(inputs), seed.noisy_input_ids.numpy())
  np.testing.assert_array_equal(take(masked), masked_seed)
  np.testing.assert_array_equal(np.where(take(masked), take(batch.labels), -100),
                                seed.labels.numpy())
  want_w = np.repeat(seed.loss_weights.numpy(), B, axis=1)
  np.testing.assert_allclose(np.where(masked_seed, take(weight), 0.0),
                             np.where(masked_seed, want_w, 0.0), rtol=1e-6)
  # denominators: the supervised tokens (the seed: the step's loss-mask count, or every
  # token without a mask; ours: the labelled rows)
  assert float(seed.loss_denominator) == float(count_labels(batch)) == S * (L - prompt)

  logits = np.random.default_rng(1).normal(0, 2, batch.stream.shape + (V,)).astype(np.float32)
  by_position = np.take_along_axis(logits, at[..., None], axis=1)  # the noisy rows [S, L, V]
  want = float(task.loss(_SeedModel(), types.SimpleNamespace(corrupted=seed),
                         (torch.as_tensor(by_position), torch.arange(L))).detach())
  got = float(bd3lm.score(jnp.asarray(logits), batch.labels, masked, weight, cfg.objective)
              / count_labels(batch))
  np.testing.assert_allclose(got, want, rtol=2e-6)
