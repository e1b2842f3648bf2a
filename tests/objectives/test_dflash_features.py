"""DFlash with precomputed target features (`drafter.features`): the drafter's loss and
gradients from features on disk equal those with the co-hosted target, bad folders fail
before compiling, and training reads them and resumes."""

import functools
import json
import os
import warnings

import jax
import numpy as np
import pytest

from bdlm_jax import (ConfigError, export_hf, init_params, load_config, loss_fn, make_batch,
                      make_mesh)
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.configure import replace
from bdlm_jax.data.features import FeatureRecords
from bdlm_jax.feed import Feed
from bdlm_jax.loop import train
from bdlm_jax.params import shared_weights
from experiments import dflash_features
from tests.objectives.test_dflash import _cfg, _logical_batch, _loss_and_grads
from tests.parallel.test_strategies import assert_close


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """Features of `_logical_batch()` by the target of `init_params(_cfg(), key 0)`."""
  out = str(tmp_path_factory.mktemp("features"))
  tokens, seg, prot = _logical_batch()
  target = init_params(_cfg(), jax.random.key(0))["target"]
  dflash_features.write_features(_cfg(), target, [dict(tokens=tokens, segment_ids=seg,
                                                       protected=prot)], out, len(tokens))
  return out


def _records(folder):
  records = FeatureRecords(folder)
  return {k: np.stack([records[i][k] for i in range(len(records))]) for k in records[0]}


@functools.cache
def _cohosted(folder):
  """Loss and gradients with the target in the step, on the records' tokens as read (int32:
  the anchors are seeded by the tokens' bytes)."""
  raw = _records(folder)
  batch = make_batch(_cfg(), raw["tokens"], raw["segment_ids"], raw["protected"])
  return _loss_and_grads(_cfg(), None, batch)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,parallel,kept", [
    ("none", {}, 0), ("csbp_ring", dict(seq=4), 0),
    # Context pruning reads the kept rows from the batch's features in place: 58 of 64 (every
    # row before the last anchor, 57 at most here).
    ("bp", dict(seq=2, data=2), 58)])
def test_features_from_disk_give_the_cohosted_loss_and_drafter_gradients(folder, strategy,
                                                                          parallel, kept):
  cfg = replace(_cfg(strategy, **parallel),
                drafter=dict(features=folder, kept_context_rows=kept))
  mesh = make_mesh(cfg)
  cohosted = init_params(_cfg(), jax.random.key(0))  # the reference's drafter and target
  params = jax.tree.map(np.asarray, dict(drafter=cohosted["drafter"],
                                         target=shared_weights(cohosted["target"])))
  step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, jax.random.key(7), cfg, mesh),
                                    has_aux=True))
  raw = _records(folder)
  (loss, _), grads = step(params, make_batch(cfg, raw["tokens"], raw["segment_ids"],
                                             raw["protected"], raw["features"]))
  ref_loss, ref_grads = _cohosted(folder)
  assert_close(float(loss), jax.tree.map(np.asarray, grads["drafter"]), ref_loss,
               ref_grads["drafter"])
  assert "layers" not in grads["target"]


@pytest.mark.parametrize("strategy,parallel", [
    ("cp_ring", dict(seq=4)), pytest.param("bp", dict(seq=2, fsdp=2), marks=pytest.mark.slow)])
def test_features_made_on_a_mesh_equal_those_made_on_one_device(strategy, parallel):
  """The target's forward split as the run splits it (a zigzag over 4 ranks; a context
  replicated on 2 with its weights split over 2 more) gives each position's features."""
  tokens, seg, prot = _logical_batch()
  raw = dict(tokens=tokens, segment_ids=seg, protected=prot)
  want = dflash_features.target_features(_cfg(), init_params(_cfg(), jax.random.key(0))[
      "target"])(raw)
  cfg = _cfg(strategy, **parallel)
  mesh = make_mesh(cfg)
  target = init_params(cfg, jax.random.key(0), mesh)["target"]
  got = dflash_features.target_features(cfg, target, mesh)(raw)
  assert got.shape == want.shape and want.shape[:2] == tokens.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _bad_folder(tmp_path, meta, missing=()):
  for name in ("tokens", "segment_ids", "protected", "features"):
    if name not in missing:
      np.save(tmp_path / f"{name}.npy", np.zeros(1))
  (tmp_path / "meta.json").write_text(json.dumps(meta))
  return str(tmp_path)


def test_a_folder_that_does_not_fit_is_refused_naming_each_mismatch(tmp_path):
  folder = _bad_folder(tmp_path, dict(seq_len=32, target_layers=[0, 1], d_model=48))
  cfg = replace(_cfg(), drafter=dict(features=folder))
  with pytest.raises(ConfigError) as err:
    Feed(cfg, make_mesh(cfg))
  for part in ("seq_len 32 (config data.seq_len: 64)", "target_layers [0, 1]",
               "d_model 48 (config model.d_model: 32)"):
    assert part in str(err.value)


@pytest.mark.parametrize("where,message", [("nowhere", "does not exist"),
                                           ("partial", "lacks features.npy")])
def test_a_missing_folder_or_file_is_refused(tmp_path, where, message):
  folder = (_bad_folder(tmp_path, {}, missing=("features",)) if where == "partial"
            else str(tmp_path / where))
  cfg = replace(_cfg(), drafter=dict(features=folder))
  with pytest.raises(ConfigError, match=message):
    Feed(cfg, make_mesh(cfg))


@pytest.mark.parametrize("override,message", [
    (dict(objective=dict(draft_loss="kl")), "needs the target's final hidden states"),
    (dict(train=dict(eval_every=10)), "set train.eval_every=0")])
def test_features_refuse_what_needs_the_target_at_load(override, message):
  with pytest.raises(ConfigError, match=message):
    replace(_cfg(), drafter=dict(features="some/folder"), **override)


def test_a_batch_without_its_features_is_refused(folder):
  cfg = replace(_cfg(), drafter=dict(features=folder))
  with pytest.raises(ConfigError, match="make_batch needs the target's features"):
    make_batch(cfg, *_logical_batch())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """configs/dflash_tiny.py, small, with a random target (its HF folder) and the features
  that experiments/dflash_features.py writes for its first 16 training sequences."""
  tmp = str(tmp_path_factory.mktemp("tiny"))
  sets = ["train.batch_size=4", "train.log_every=1", "train.ckpt_every=2",
          "train.warmup_steps=0", "train.eval_every=0", "parallel.strategy=csbp_ring",
          "parallel.seq=2"]
  cfg = load_config("configs/dflash_tiny.py", sets)
  features, hf = os.path.join(tmp, "features"), os.path.join(tmp, "hf")
  dflash_features.main(["--config", "configs/dflash_tiny.py", "--out", features,
                        "--sequences", "16", "--random-target",
                        *(a for s in sets for a in ("--set", s))])
  target = dflash_features.random_target(replace(cfg, drafter=dict(target="")))
  export_hf(target, replace(cfg, objective=dict(name="bd3lm")), hf)
  return replace(cfg, drafter=dict(target=hf, features=features))


def test_the_feed_of_features_resumes_where_it_stopped(tiny):
  mesh = make_mesh(tiny)
  feed = Feed(tiny, mesh)
  next(feed), next(feed)
  state, want = feed.get_state(), next(feed)
  again = Feed(tiny, mesh)
  again.set_state(state)
  got = next(again)
  assert got.context.shape == (4, want.tokens.shape[1], 2, tiny.model.d_model)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_only_the_shared_weights_of_the_target_are_loaded(tiny):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the folder's layers are expected, not "unused"
    params = load_target(tiny, make_mesh(tiny))
  assert set(params) == {"embed", "final_norm"}  # tied embeddings: no lm_head


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:resuming .* with changed settings")
def test_training_reads_features_and_resumes(tiny, tmp_path):
  workdir = str(tmp_path / "run")
  first = train(replace(tiny, train=dict(steps=2)), workdir, progress=False)
  resumed = train(replace(tiny, train=dict(steps=4)), workdir, resume=True, progress=False,
                  allow_changes=True)  # a longer run
  assert [r["step"] for r in first + resumed] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in first + resumed)
