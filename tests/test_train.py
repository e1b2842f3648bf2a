"""The training loop for real: the loss falls, resume is exact, accumulation is exact."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bdlm_jax import feed, loop
from bdlm_jax.batch import make_batch
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.configure import load_config, replace
from bdlm_jax.data import make_dataset
from bdlm_jax.errors import ConfigError
from bdlm_jax.loss import loss_fn
from bdlm_jax.parallel.mesh import _say_devices_left_idle, make_mesh
from bdlm_jax.params import init_params
from bdlm_jax.spec import resolve
from bdlm_jax.train import _accumulated_grads, abstract_state, init_state, make_train_step
from tests.close import assert_trees_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 60


def tiny_config(**train):
  """configs/quickstart_bd3lm.py shrunk to a one-layer model that trains in seconds."""
  return replace(
      load_config(os.path.join(REPO, "configs", "quickstart_bd3lm.py")),
      model=dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64),
      data=dict(seq_len=32), objective=dict(block_size=8),
      train=dict(dict(steps=STEPS, batch_size=16, lr=1e-2, warmup_steps=5, log_every=1,
                      ckpt_every=20, eval_every=0), **train))


class Preempted(Exception):
  """Stands in for a job killed between two steps."""


class StopAfter:
  """A data iterator that raises `error` once it has given `n` batches."""

  def __init__(self, data, n: int, error=Preempted):
    self._data, self._left, self._error = data, n, error

  def __next__(self):
    if not self._left:
      raise self._error
    self._left -= 1
    return next(self._data)

  def get_state(self):
    return self._data.get_state()

  def set_state(self, state):
    self._data.set_state(state)


def final_state(cfg, workdir):
  with Checkpointer(workdir, cfg, save_every=1, max_to_keep=1) as ckpt:
    step, state, _ = ckpt.restore(abstract_state(cfg, make_mesh(cfg)))
  return step, state


def losses(rows):
  return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """(history, workdir) of STEPS uninterrupted steps, async checkpoints."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  return loop.train(tiny_config(async_checkpoint=True), workdir, progress=False), workdir


@pytest.mark.slow
def test_training_on_embedded_default_lowers_loss(straight_run):
  history, _ = straight_run
  assert [row["step"] for row in history] == list(range(1, STEPS + 1))
  first = np.mean([row["loss"] for row in history[:3]])
  last = np.mean([row["loss"] for row in history[-10:]])
  assert np.isfinite([row["loss"] for row in history]).all()
  assert last < 0.6 * first, (first, last)


def test_every_logged_row_has_the_throughput_metrics(straight_run):
  history, _ = straight_run
  for row in history:
    for key in ("loss", "tokens_per_s", "step_time_s", "lr", "grad_norm"):
      assert np.isfinite(row[key]) and row[key] >= 0, (key, row)
    assert "mfu" in row and row["mfu"] is None  # CPU has no known peak; train.peak_tflops=0
  assert history[0]["lr"] < history[4]["lr"]  # warmup


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(straight_run, tmp_path, monkeypatch):
  history, straight_dir = straight_run
  workdir = str(tmp_path / "resumed")
  make_dataset = feed.make_dataset
  # Killed after step 30; the last checkpoint is step 20, so steps 21-30 are trained again.
  monkeypatch.setattr(feed, "make_dataset", lambda *a, **kw: StopAfter(make_dataset(*a, **kw), 30))
  with pytest.raises(Preempted):
    loop.train(tiny_config(async_checkpoint=True), workdir, progress=False)
  monkeypatch.setattr(feed, "make_dataset", make_dataset)
  cfg = tiny_config(async_checkpoint=False)
  resumed = loop.train(cfg, workdir, resume=True, progress=False)

  assert resumed[0]["step"] == 21
  straight = losses(history)
  for step, loss in losses(resumed).items():
    assert loss == pytest.approx(straight[step], rel=1e-6), step
  (step_a, state_a), (step_b, state_b) = final_state(cfg, straight_dir), final_state(cfg, workdir)
  assert step_a == step_b == STEPS == int(state_b.step)
  assert_trees_close(state_b, state_a, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(data=2), dict(data=2, strategy="csbp_ring", seq=4)],
                         ids=["data2", "data2_seq4"])
def test_grad_accumulation_matches_single_batch(parallel):
  """With eps_min = eps_max = 1 every token is masked with weight 1, so the corruption does
  not depend on the key or on how the batch is cut; the loss is then exactly the mean token
  CE, and 2 micro-batches must give the full batch's gradient. The sequences hold 32, 24,
  10 and 3 real tokens, so every split into pairs has unequal valid-token counts and a plain
  mean of micro-batch losses would differ."""
  cfg = replace(tiny_config(batch_size=4, grad_accum=2), objective=dict(eps_min=1.0, eps_max=1.0),
                parallel=parallel)
  single = replace(cfg, train=dict(grad_accum=1))
  mesh = make_mesh(cfg)
  rng = np.random.default_rng(0)
  lengths = np.array([32, 24, 10, 3])
  real = np.arange(32)[None, :] < lengths[:, None]
  tokens = np.where(real, rng.integers(0, 256, (4, 32)), 258)
  batch = make_batch(cfg, tokens, segment_ids=real.astype(np.int32))
  params = init_params(cfg, jax.random.key(0), mesh)
  key = jax.random.key(1)

  spec = resolve(cfg, mesh)
  accumulated, metrics = jax.jit(lambda p: _accumulated_grads(spec, p, {}, batch, key))(params)
  (loss, full_metrics), grads = jax.jit(jax.value_and_grad(
      lambda p: loss_fn(p, batch, key, single, mesh), has_aux=True))(params)

  assert int(metrics["valid_tokens"]) == int(full_metrics["valid_tokens"]) == lengths.sum()
  assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
  for a, g in zip(jax.tree.leaves(accumulated), jax.tree.leaves(grads)):
    assert a.sharding.is_equivalent_to(g.sharding, a.ndim)  # accumulated as ZeRO-3 shards
    scale = float(np.abs(g).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(g), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:train.lr=.* cannot train")
@pytest.mark.parametrize("fault", [None, "inf_weights", "inf_lr", "huge_lr"])
def test_a_step_is_applied_only_if_loss_gradients_and_update_are_finite(fault):
  """Inf weights make the loss and gradients non-finite; lr=1e39 (inf in float32) makes the
  update non-finite; lr=1e30 a finite update ~1e30 x the weights (over MAX_UPDATE_RATIO).
  Such a step gives back the state it was given, and says so."""
  lr = {"inf_lr": 1e39, "huge_lr": 1e30}.get(fault, 1e-2)
  cfg = tiny_config(batch_size=4, lr=lr, warmup_steps=0)  # the first step at the full lr
  mesh = make_mesh(cfg)
  state = init_state(cfg, jax.random.key(0), mesh)
  if fault == "inf_weights":
    state = state._replace(params=jax.tree.map(lambda w: w.at[(0,) * w.ndim].set(jnp.inf),
                                               state.params))
  before = jax.device_get(state)  # the step donates `state`
  tokens = np.random.default_rng(0).integers(0, 256, (4, 32))
  after, metrics = make_train_step(cfg, mesh)(state, make_batch(cfg, tokens), jax.random.key(1))
  unchanged = [np.array_equal(a, b, equal_nan=True)
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after)))]
  assert int(metrics["skipped"]) == (fault is not None)
  assert all(unchanged) == (fault is not None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_diverging_run_keeps_and_names_its_last_checkpoint_before_the_spike(tmp_path,
                                                                             monkeypatch):
  """From step 13 on the weights are scaled by 1e3 before each step: the loss grows, finite
  but far over SPIKE_FACTOR x its recent median, until it overflows and the steps are
  skipped. Spikes are not checkpointed, so with ckpt_every=1 and max_to_keep=2 step 12's
  checkpoint survives, and it is the one the error names."""
  real_step, calls = loop.make_train_step, iter(range(1, 10**6))

  def diverging(cfg, mesh):
    step = real_step(cfg, mesh)

    def run(state, batch, key):
      if next(calls) > 12:
        state = state._replace(params=jax.tree.map(lambda w: w * 1e3, state.params))
      return step(state, batch, key)
    return run

  monkeypatch.setattr(loop, "make_train_step", diverging)
  cfg = tiny_config(steps=40, ckpt_every=1, max_to_keep=2, max_bad_steps=3)
  workdir = str(tmp_path / "run")
  with pytest.warns(UserWarning, match=r"step 13: loss .* is over 3x the median .* of the "
                                       r"recent steps; not checkpointed"):
    with pytest.raises(loop.BadStepsError, match=rf"Last good checkpoint: {workdir}/12 \(step "
                                                 r"12; finite; its loss, update/weight ratio"):
      loop.train(cfg, workdir, progress=False)
  step, state = final_state(cfg, workdir)
  assert step == 12
  assert max(float(np.abs(w).max()) for w in jax.tree.leaves(state.params)) < 100


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:step 1[4-6]:")  # the steps after it spike too
def test_a_state_after_an_outsized_update_is_not_checkpointed(tmp_path, monkeypatch):
  """Before step 13 only, Adam's second moments are cut 1e5x (a corrupted optimiser state):
  that step's update is ~20x the recent ones, yet under MAX_UPDATE_RATIO, and its loss (of
  the weights before it) is normal. The state it gives is ruined (its loss, at step 14, is
  over 3x the others'), and is not checkpointed: before, the loss alone judged a step."""
  real_step, calls = loop.make_train_step, iter(range(1, 10**6))

  def corrupted(cfg, mesh):
    step = real_step(cfg, mesh)

    def run(state, batch, key):
      if next(calls) == 13:
        nu = optax.tree_utils.tree_get(state.opt_state, "nu")
        state = state._replace(opt_state=optax.tree_utils.tree_set(
            state.opt_state, nu=jax.tree.map(lambda v: v * 1e-5, nu)))
      return step(state, batch, key)
    return run

  monkeypatch.setattr(loop, "make_train_step", corrupted)
  cfg = tiny_config(steps=16, ckpt_every=1, max_to_keep=20)
  with pytest.warns(UserWarning, match=r"step 13: update_ratio .* is over 3x the median"):
    rows = loop.train(cfg, str(tmp_path / "run"), progress=False)
  assert rows[12]["update_ratio"] > 10 * rows[11]["update_ratio"]
  assert rows[13]["loss"] > 3 * rows[11]["loss"]
  saved = [int(d) for d in os.listdir(tmp_path / "run") if d.isdigit()]
  assert 12 in saved and 13 not in saved


def test_token_ids_outside_the_vocabulary_are_refused():
  cfg = tiny_config()
  tokens = np.zeros((2, 32), np.int32)
  tokens[1, 5] = cfg.model.vocab_size
  with pytest.raises(ConfigError, match=r"token ids must lie in \[0, model.vocab_size=260\); "
                                        r"got min 0, max 260"):
    make_batch(cfg, tokens)


def test_the_mask_id_in_the_data_is_refused():
  cfg = tiny_config()
  tokens = np.full((2, 32), cfg.objective.mask_token_id, np.int32)
  with pytest.raises(ConfigError, match="token id 259 is objective.mask_token_id, reserved for "
                                        r"\[MASK\], and appears in the data"):
    make_batch(cfg, tokens)


def test_a_mesh_smaller_than_the_devices_says_once_how_many_it_uses(caplog):
  cfg = replace(tiny_config(batch_size=3), parallel=dict(data=3))
  _say_devices_left_idle.cache_clear()  # another test may have built this mesh
  with caplog.at_level(logging.WARNING, logger="bdlm_jax.parallel.mesh"):
    make_mesh(cfg), make_mesh(cfg), make_mesh(replace(cfg, train=dict(batch_size=8),
                                                      parallel=dict(data=8)))
  assert [r.getMessage() for r in caplog.records] == [
      "the mesh data*fsdp*seq = 3*1*1 uses 3 of the 8 visible devices; the other 5 stay idle"]


def test_a_mesh_larger_than_the_devices_is_refused_before_the_workdir_is_made(tmp_path):
  cfg = tiny_config(batch_size=16)
  cfg = replace(cfg, parallel=dict(data=16))
  with pytest.raises(ConfigError, match="needs 16 devices, but only 8 are visible"):
    loop.train(cfg, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_diffusiongemma_on_prompts_longer_than_the_row_trains_the_responses_and_says_so(
    tmp_path):
  """Every arithmetic prompt ("User: 123+45=\\nAssistant: ") is longer than L = 16. Before,
  each conversation was cut to its first 16 tokens, all prompt: no response token was
  trained (the loss was the encoder's alone), and nothing said so. Now each keeps its
  response's start, the prompt loses its own, and the cut is warned about and logged."""
  cfg = replace(load_config(os.path.join(REPO, "configs", "diffusiongemma_tiny.py")),
                model=dict(n_layers=1), data=dict(seq_len=16),
                train=dict(steps=2, batch_size=4, log_every=1, eval_every=0, ckpt_every=10))
  with pytest.warns(UserWarning, match=r"of the \d+ conversations of the latest steps are "
                                       r"longer than data.seq_len=16: \d+ prompt tokens cut"):
    rows = loop.train(cfg, str(tmp_path / "run"), progress=False)
  for row in rows:
    assert row["truncated_examples"] == row["examples"] > 0 and row["prompt_tokens_cut"] > 0
  batch = next(make_dataset(cfg.data, batch_size=4, seed=0, vocab_size=cfg.model.vocab_size,
                            block_size=4))
  response = (batch["segment_ids"] > 0) & ~batch["protected"]
  assert response.any(axis=1).all()  # every row has response tokens to train
