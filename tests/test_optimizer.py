"""The optimiser as the seed's recipes set it: torch's AdamW on one parameter group (every
parameter decayed), its epsilon, global-norm clipping, and the seed's own LR schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bdlm_jax.config import TrainConfig
from bdlm_jax.optimizer import learning_rate, make_optimizer

torch = pytest.importorskip("torch")

SEED_RECIPE = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-5, weight_decay=0.1, grad_clip=1.0,
                   decay_vectors=True, warmup_steps=3, steps=10, min_lr_ratio=0.1,
                   schedule="seed_cosine")


def _params_and_grads(rng):
  params = {"w": rng.normal(size=(4, 3)).astype(np.float32),
            "scale": rng.normal(size=(3,)).astype(np.float32)}
  grads = [{k: 3 * rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
           for _ in range(5)]
  return params, grads


def test_adamw_on_every_parameter_equals_torch():
  """decay_vectors=True, Adam's eps and clipping: five updates equal torch.optim.AdamW's with
  one parameter group, the learning rate set per step from our schedule."""
  cfg = TrainConfig(**SEED_RECIPE)
  params, grads = _params_and_grads(np.random.default_rng(0))
  opt = make_optimizer(cfg)
  ours, state = {k: jnp.asarray(v) for k, v in params.items()}, None
  state = opt.init(ours)
  theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
  torch_opt = torch.optim.AdamW(list(theirs.values()), lr=cfg.lr, betas=(cfg.b1, cfg.b2),
                                eps=cfg.eps, weight_decay=cfg.weight_decay)
  schedule = learning_rate(cfg)
  for step, g in enumerate(grads):
    updates, state = opt.update({k: jnp.asarray(v) for k, v in g.items()}, state, ours)
    ours = optax.apply_updates(ours, updates)
    for k, p in theirs.items():
      p.grad = torch.tensor(g[k])
    torch.nn.utils.clip_grad_norm_(list(theirs.values()), cfg.grad_clip)
    torch_opt.param_groups[0]["lr"] = float(schedule(step))
    torch_opt.step()
  for k in params:
    np.testing.assert_allclose(ours[k], theirs[k].detach().numpy(), rtol=2e-5, atol=1e-7)


def test_vectors_are_not_decayed_by_default():
  cfg = TrainConfig(**dict(SEED_RECIPE, decay_vectors=False))
  params = {"w": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
  opt = make_optimizer(cfg)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = opt.update(zero, opt.init(params), params)
  assert float(jnp.abs(updates["scale"]).max()) == 0.0
  assert float(jnp.abs(updates["w"]).max()) > 0.0


def test_seed_cosine_is_the_seeds_schedule():
  """Our `seed_cosine` against the seed's own scheduler (Turbo-dLLM 0.1.6), update by update
  (the seed numbers them from 1), warm-up and past the end included."""
  seed = pytest.importorskip("dllm_parallel.training.optimizer_setup")
  cfg = TrainConfig(**SEED_RECIPE)
  torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
  sched = seed.RunSpecLRScheduler(torch_opt, scheduler_type="cosine",
                                  warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
                                  min_lr=cfg.lr * cfg.min_lr_ratio)
  ours = learning_rate(cfg)
  for count in range(cfg.steps + 5):
    np.testing.assert_allclose(float(ours(count)), sched.step(count + 1), rtol=1e-6)
