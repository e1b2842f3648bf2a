"""DFlash drafter training (docs/dflash.md): anchors and draft rows, the mask they imply,
exactness of every strategy against one device, a frozen target, and bad input."""

import functools

import jax
import numpy as np
import pytest

from bdlm_jax import (ConfigError, ar_logits, draft_logits, export_hf, init_params, loss_fn,
                      make_batch, make_mesh)
from bdlm_jax.checkpoint import Checkpointer
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.kernels.mask import allowed
from bdlm_jax.objectives import dflash
from bdlm_jax.train import init_state, make_train_step
from tests.parallel.test_strategies import assert_close

L, B, A = 64, 4, 8


def _cfg(strategy="none", **parallel):
  return replace(
      Config(),
      model=dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                 attention_chunk=16),
      drafter=dict(n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48),
      data=dict(seq_len=L), objective=dict(name="dflash", block_size=B, max_anchors=A),
      parallel=dict(strategy=strategy, **parallel), train=dict(batch_size=4))


def _logical_batch(seed=5):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 250, (4, L))
  seg = np.sort(rng.integers(1, 4, (4, L)), axis=1)  # packed documents
  seg[:, -5:] = 0  # padding
  seg[3, 6:] = 0  # a sequence with fewer anchor candidates than max_anchors
  protected = rng.random((4, L)) < 0.2  # SFT-style prompt tokens
  return tokens, seg, protected


def test_draft_rows_hold_anchored_blocks_of_the_data():
  tokens, seg, prot = _logical_batch()
  rows = dflash.logical_rows(tokens, seg, prot, _cfg().objective)
  ok = dflash.anchor_candidates(seg, prot)
  for s in range(4):
    block = rows["block"][s, :A * B].reshape(A, B)
    valid = rows["seg"][s, :A * B].reshape(A, B)[:, 0] > 0
    anchors = block[valid, 0]
    assert ok[s, anchors].all() and (np.diff(anchors) > 0).all()
    assert valid.sum() == min(A, ok[s].sum())  # sequence 3 has fewer candidates
    for a, pos, labels, inputs in zip(anchors, rows["pos"][s, :A * B].reshape(A, B)[valid],
                                      rows["labels"][s, :A * B].reshape(A, B)[valid],
                                      rows["maskable"][s, :A * B].reshape(A, B)[valid]):
      assert (pos == a + np.arange(B)).all() and labels[0] == -1
      assert not inputs[0] and inputs[1:].all()  # [x_a, MASK, ...]
      for k in range(1, B):
        p = a + k
        scored = p < L and seg[s, p] == seg[s, a] and not prot[s, p]
        assert labels[k] == (tokens[s, p] if scored else -1)
  context = {k: v[:, A * B:] for k, v in rows.items()}
  assert (context["tokens"] == tokens).all() and (context["labels"] == -1).all()


def test_strided_anchors_spread_evenly_and_uniform_ones_follow_the_batch():
  ok = np.zeros((1, 400), bool)
  ok[0, 100:300] = True
  strided = dflash.pick_anchors(ok, 4, "strided", seed=0)[0]
  assert (strided == [125, 175, 225, 275]).all()
  draw = lambda seed: dflash.pick_anchors(ok, 4, "uniform", seed)[0]
  assert (draw(1) == draw(1)).all() and not (draw(1) == draw(2)).all()


def test_a_draft_query_sees_its_block_and_the_context_before_its_anchor():
  tokens, seg, prot = _logical_batch()
  rows = dflash.logical_rows(tokens, seg, prot, _cfg().objective)  # layout "none": the same
  meta = make_batch(_cfg(), tokens, seg, prot).meta
  mask = np.asarray(allowed(*(jax.tree.map(lambda x: x[:1], meta),) * 2))[0]
  q = np.flatnonzero(rows["seg"][0, :A * B] > 0)
  draft_keys, context_keys = mask[q, :A * B], mask[q, A * B:]
  anchor = rows["block"][0, q]
  doc = seg[0][np.minimum(anchor, L - 1)]
  assert (context_keys == ((np.arange(L) < anchor[:, None])
                           & (seg[0][None] == doc[:, None]))).all()
  assert (draft_keys == (rows["block"][0, None, :A * B] == anchor[:, None])
          & (rows["seg"][0, None, :A * B] > 0)).all()


def _loss_and_grads(cfg, mesh, batch=None):
  batch = make_batch(cfg, *_logical_batch()) if batch is None else batch
  params = init_params(cfg, jax.random.key(0), mesh)
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, jax.random.key(7), cfg, mesh),
                                    has_aux=True))
  (loss, _), grads = step(params, batch)
  return float(loss), jax.tree.map(np.asarray, grads)


@functools.cache
def _reference(draft_loss="ce"):
  return _loss_and_grads(replace(_cfg(), objective=dict(draft_loss=draft_loss)), None)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,parallel", [
    ("csbp_ring", dict(seq=8, draft_transport="kv")), ("csbp_allgather", dict(seq=4, fsdp=2)),
    ("cp_ring", dict(seq=4, data=2)), ("cp_allgather", dict(seq=8)), ("bp", dict(seq=4)),
    ("csbp_ring", dict(seq=2, data=2, fsdp=2)), ("cp_replicated_drafts", dict(seq=4)),
    ("csbp_ring", dict(seq=8, draft_transport="query"))])
def test_every_strategy_gives_the_single_device_loss_and_drafter_gradients(strategy, parallel):
  cfg = _cfg(strategy, **parallel)
  loss, grads = _loss_and_grads(cfg, make_mesh(cfg))
  ref_loss, ref_grads = _reference()
  assert_close(loss, grads["drafter"], ref_loss, ref_grads["drafter"])
  # The target is frozen inside the loss: whoever differentiates it gets zeros.
  assert all(not g.any() for g in jax.tree.leaves(grads["target"]))
  assert all(np.linalg.norm(g) > 0 for g in jax.tree.leaves(grads["drafter"]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,parallel", [("csbp_ring", dict(seq=8)),
                                               ("bp", dict(seq=2, data=2, fsdp=2))])
def test_the_kl_loss_is_exact_under_every_layout(strategy, parallel):
  cfg = replace(_cfg(strategy, **parallel), objective=dict(draft_loss="kl"))
  loss, grads = _loss_and_grads(cfg, make_mesh(cfg))
  ref_loss, ref_grads = _reference("kl")
  assert_close(loss, grads["drafter"], ref_loss, ref_grads["drafter"])


@pytest.mark.slow
def test_the_kl_loss_compares_each_slot_with_the_targets_next_token_distribution():
  """One document per sequence: the target's logits at a + k - 1 are `ar_logits`'."""
  cfg = replace(_cfg(), objective=dict(draft_loss="kl"))
  tokens = np.random.default_rng(9).integers(0, 250, (4, L))
  params = init_params(cfg, jax.random.key(3))
  loss, metrics = loss_fn(params, make_batch(cfg, tokens), None, cfg)
  logits, rows = draft_logits(params, cfg, tokens)
  teacher = np.asarray(ar_logits(params["target"], cfg, tokens), np.float64)
  log_softmax = lambda x: np.asarray(jax.nn.log_softmax(x, axis=-1))
  pos = np.asarray(rows.pos)[:, :A * B].reshape(logits.shape[:3])
  labels = np.asarray(rows.labels)[:, :A * B].reshape(logits.shape[:3])
  t = log_softmax(np.take_along_axis(teacher, np.clip(pos - 1, 0, L - 1).reshape(4, -1)[..., None],
                                     1).reshape(logits.shape))
  d = log_softmax(np.asarray(logits, np.float64))
  k = pos - np.asarray(rows.block)[:, :A * B].reshape(pos.shape)
  per_slot = (np.exp(t) * (t - d)).sum(-1) * np.exp(-(k - 1) / cfg.objective.gamma)
  want = per_slot[labels >= 0].sum() / (labels >= 0).sum()
  assert abs(float(loss) - want) < 1e-5 * want and int(metrics["valid_tokens"]) > 0


@pytest.mark.slow
def test_the_pallas_kernel_gives_the_xla_loss_and_gradients():
  """Draft queries against [draft ; context] keys: unequal query and key rows in the kernel."""
  cfg = replace(_cfg("csbp_ring", seq=2), model=dict(attention_impl="pallas"))
  loss, grads = _loss_and_grads(cfg, make_mesh(cfg))
  ref_loss, ref_grads = _reference()
  assert_close(loss, grads["drafter"], ref_loss, ref_grads["drafter"])


@pytest.mark.slow
def test_a_train_step_updates_the_drafter_alone():
  cfg = replace(_cfg("csbp_ring", seq=4), train=dict(warmup_steps=0))
  mesh = make_mesh(cfg)
  state = init_state(cfg, jax.random.key(0), mesh)
  opt_leaves = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_leaves_with_path(state.opt_state)}
  assert opt_leaves and not any("target" in p for p in opt_leaves)
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = make_train_step(cfg, mesh)(state, make_batch(cfg, *_logical_batch()),
                                              jax.random.key(1))
  assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before,
                         state.params)
  assert not any(jax.tree.leaves(changed["target"])) and all(jax.tree.leaves(changed["drafter"]))


@pytest.mark.parametrize("override,message", [
    (dict(data=dict(seq_len=2), objective=dict(block_size=4)), "shorter than one draft block"),
    (dict(drafter=dict(target_layers="1,4")), r"target_layers \[4\] lie outside"),
    (dict(drafter=dict(target_layers="1,x")), "comma-separated integers"),
    (dict(objective=dict(max_anchors=2), parallel=dict(strategy="csbp_ring", seq=4)),
     "max_anchors=2 draft blocks cannot be split"),
    (dict(model=dict(layer_pattern="local,global", sliding_window=8)), "all-global target"),
    (dict(parallel=dict(draft_transport="queries")), r"draft_transport='queries' is not one of"),
    (dict(parallel=dict(strategy="cp_ring", seq=4, draft_transport="query")),
     "moves only the context"),
    (dict(objective=dict(name="bd3lm"), parallel=dict(strategy="csbp_ring", seq=4,
                                                      draft_transport="query")),
     "needs a drafter objective"),
])
def test_bad_drafter_configs_fail_at_load(override, message):
  with pytest.raises(ConfigError, match=message):
    replace(_cfg(), **override)


@pytest.mark.parametrize("strategy,parallel", [("none", {}), ("bp", dict(seq=4))])
def test_a_strategy_that_moves_nothing_takes_any_draft_transport(strategy, parallel):
  for transport in ("auto", "kv", "query"):
    replace(_cfg(strategy, **parallel, draft_transport=transport))


def test_the_mask_id_in_the_data_is_refused():
  tokens, seg, prot = _logical_batch()
  tokens[1, 7] = _cfg().objective.mask_token_id
  with pytest.raises(ConfigError, match="reserved for \\[MASK\\]"):
    make_batch(_cfg(), tokens, seg, prot)


def test_a_target_that_does_not_fit_is_refused(tmp_path):
  other = replace(_cfg(), model=dict(d_model=48), objective=dict(name="bd3lm"))
  export_hf(init_params(other, jax.random.key(0)), other, str(tmp_path / "hf"))
  cfg = replace(_cfg(), drafter=dict(target=str(tmp_path / "hf")))
  with pytest.raises(ConfigError, match="d_model"):
    load_target(cfg, make_mesh(cfg))
  fits = replace(cfg, model=dict(d_model=48))
  params = load_target(fits, make_mesh(fits))
  assert jax.tree.map(np.shape, params) == jax.tree.map(
      np.shape, init_params(fits, jax.random.key(0))["target"])
  with pytest.raises(ConfigError, match="drafter.target"):
    load_target(replace(cfg, drafter=dict(target="")), make_mesh(cfg))


def test_a_target_that_is_a_drafter_run_is_refused_in_one_line(tmp_path):
  """Before: the drafter's own params (a target inside) went into init_state, which failed
  with a pytree ValueError."""
  cfg = _cfg()
  with Checkpointer(str(tmp_path / "drafter_run"), cfg, save_every=1, max_to_keep=1,
                    async_save=False) as ckpt:
    ckpt.save(1, {"w": jax.numpy.zeros(2)}, force=True)
    ckpt.wait()
  target = replace(cfg, drafter=dict(target=str(tmp_path / "drafter_run")))
  with pytest.raises(ConfigError, match=r"drafter_run' holds a drafter \(objective.name="
                                        r"'dflash'\), not a target model"):
    load_target(target, make_mesh(target))
