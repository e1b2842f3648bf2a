"""Fast-dLLM v2 in the seed's form against the seed's own code (Turbo-dLLM 0.1.6, package
`dllm_parallel`), fed the same noise: corruption of both copies, labels, denominator, loss.

The seed's runtime draws t [S, N] then u [S, L] from one torch generator; the test replays
that generator and gives the same tables to `fast_dllm_v2.corrupt_with`. Skipped where the
seed's package is absent (CI installs it: requirements-seed.txt).
"""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax import make_batch
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.objectives import fast_dllm_v2

torch = pytest.importorskip("torch")
seed_fdv2 = pytest.importorskip("dllm_parallel.core.objectives.fast_dllm_v2")
seed_model = pytest.importorskip("dllm_parallel.core.models.backbones.nemotron.model")

S, L, B, V, D, MASK, EPS, SEED = 2, 32, 8, 64, 16, 63, 1e-3, 11
SEED_FORM = dict(boundary_row="noisy", keep_mask_logit=True, antithetic=False)


def _cfg(**objective):
  return replace(Config(), model=dict(vocab_size=V),
                 data=dict(seq_len=L),
                 objective=dict(name="fast_dllm_v2", block_size=B, mask_token_id=MASK,
                                eps_min=EPS, eps_max=1.0, loss_weight="unit", **objective))


def _seed_corrupt(x0_SL, supervised_SL):
  runtime = seed_fdv2.FastDLLMv2ObjectiveRuntime(
      mask_token_id=MASK, block_size=B, seq_len=L, device=torch.device("cpu"), seed=SEED,
      token_accounting=None, noise_schedule_epsilon=EPS)  # only logged
  mask = None if supervised_SL is None else torch.as_tensor(supervised_SL)
  return runtime.corrupt(torch.as_tensor(x0_SL), supervision_mask=mask)


def _seed_noise():
  """The seed runtime's draws, in its order: t per (row, block), then u per token."""
  gen = torch.Generator().manual_seed(SEED)
  t_SN = torch.rand((S, L // B), generator=gen)
  u_SL = torch.rand((S, L), generator=gen)
  return ((1.0 - EPS) * t_SN + EPS).numpy(), u_SL.numpy()


def _ours(cfg, x0_SL, supervised_SL):
  """(noisy inputs, labels where scored else -100, denominator) in the seed's order
  [copy 1 of every row; copy 2 of every row], noisy rows only."""
  protected = None if supervised_SL is None else ~supervised_SL
  batch = make_batch(cfg, x0_SL, protected=protected)
  batch2, inputs, scored, _ = fast_dllm_v2.corrupt_with(*_seed_noise(), batch, cfg)
  seed_order = lambda x: np.concatenate([np.asarray(x)[0::2], np.asarray(x)[1::2]])[:, :L]
  labels = np.where(np.asarray(scored), np.asarray(batch2.labels), -100)
  return (seed_order(inputs), seed_order(labels), int(fast_dllm_v2.normalizer(batch)),
          seed_order(scored))


@pytest.mark.parametrize("sft", [False, True], ids=["pretraining", "sft"])
def test_seed_form_corrupts_and_labels_as_the_seed(sft):
  rng = np.random.default_rng(1 + sft)
  x0 = rng.integers(0, V - 1, (S, L))
  supervised = (np.arange(L) >= rng.integers(3, 12, (S, 1))) if sft else None
  seed = _seed_corrupt(x0, supervised)
  inputs, labels, denominator, _ = _ours(_cfg(**SEED_FORM), x0, supervised)
  np.testing.assert_array_equal(inputs, seed.noisy_input_ids.numpy())
  np.testing.assert_array_equal(labels, seed.labels.numpy())
  assert denominator == seed.valid_tokens == seed.loss_denominator


def test_our_boundary_row_is_not_the_seeds():
  """The default form scores a block's first token on the clean row: the seed's noisy-row
  labels then differ exactly at the blocks' last positions."""
  x0 = np.random.default_rng(3).integers(0, V - 1, (S, L))
  seed = _seed_corrupt(x0, None).labels.numpy()
  _, labels, _, _ = _ours(_cfg(keep_mask_logit=True, antithetic=False), x0, None)
  differs = (labels != seed).any(0)
  block_ends = np.arange(L) % B == B - 1
  assert differs[block_ends[:-1].nonzero()[0]].any() and not differs[~block_ends].any()


def _seed_loss(hidden_2SLD, w_VD, labels_2SL, denominator, exclude_mask):
  fake = types.SimpleNamespace(block_size=B, final_logit_softcap=None, runtime=None,
                               output_head=torch.nn.Linear(D, V, bias=False))
  fake.output_head.weight.data = torch.as_tensor(w_VD)
  return float(seed_model.NemotronLabsDiffusionPackedBlockDiffusionModel
               .distributed_block_diffusion_loss(
                   fake, torch.as_tensor(hidden_2SLD), torch.as_tensor(labels_2SL),
                   torch.arange(L), torch.ones(2 * S, L // B), vocab_size=V,
                   mask_token_id=MASK, seq_len=L, valid_token_count=denominator,
                   bp_loss_scale=1.0, exclude_mask_token=exclude_mask))


@pytest.mark.parametrize("keep_mask_logit", [True, False])
def test_seed_form_loss_equals_the_seeds(keep_mask_logit):
  """The same hidden states and head: the seed's loss (its Fast-dLLM v2 keeps the [MASK]
  logit; its BD3-LM task removes it) equals ours, with the same logit kept or removed."""
  rng = np.random.default_rng(4)
  x0 = rng.integers(0, V - 1, (S, L))
  hidden = rng.normal(size=(2 * S, L, D)).astype(np.float32)
  w = rng.normal(size=(V, D)).astype(np.float32)
  seed = _seed_corrupt(x0, None)
  cfg = _cfg(**dict(SEED_FORM, keep_mask_logit=keep_mask_logit))
  _, labels, denominator, scored = _ours(cfg, x0, None)
  logits = jnp.asarray(hidden) @ jnp.asarray(w).T
  ours = fast_dllm_v2.score(logits, jnp.asarray(np.maximum(labels, -1)), jnp.asarray(scored),
                            jnp.ones(scored.shape), cfg.objective) / denominator
  expected = _seed_loss(hidden, w, seed.labels.numpy(), seed.loss_denominator,
                        exclude_mask=not keep_mask_logit)
  np.testing.assert_allclose(float(ours), expected, rtol=2e-6)
