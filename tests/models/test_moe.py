"""The mixture-of-experts MLP: grouped matmuls equal a per-token reference, the router losses
follow Qwen3-MoE's formula, every strategy equals one device, and training logs the router."""

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bdlm_jax import ConfigError, init_params, loop, loss_fn, make_batch, make_mesh
from bdlm_jax.config import Config, ModelConfig
from bdlm_jax.configure import override, replace
from bdlm_jax.models.pattern import layer_types
from bdlm_jax.metrics import model_flops_per_step
from bdlm_jax.models.moe import MoE, router_losses
from bdlm_jax.models.transformer import layer_slots
from bdlm_jax.objectives import get_objective
from bdlm_jax.params import merge
from bdlm_jax.parallel.registry import plan_for, strategy_names
from bdlm_jax.parallel.strategies import make_attend
from tests.parallel import test_strategies
from tests.test_train import tiny_config

E, K = 4, 2
MOE = dict(moe_experts=E, moe_top_k=K, moe_d_ff=16, moe_aux_weight=0.01, moe_z_weight=1e-3)


def _moe(norm_topk, seed=0):
  cfg = ModelConfig(d_model=8, moe_experts=E, moe_top_k=K, moe_d_ff=12, moe_norm_topk=norm_topk)
  moe = MoE(cfg, nnx.Rngs(seed))
  moe.router.kernel[...] = jax.random.normal(jax.random.key(seed + 1), (8, E))  # sharp routing
  return moe


def _reference(moe, x_TD):
  """Each token through its k experts one by one, as Hugging Face's eager loop does."""
  probs = jax.nn.softmax(x_TD @ moe.router.kernel[...], axis=-1)
  out = []
  for t in range(x_TD.shape[0]):
    top = jax.lax.top_k(probs[t], K)[1]
    w = probs[t, top] / (probs[t, top].sum() if moe.cfg.moe_norm_topk else 1.0)
    expert = lambda e: (jax.nn.silu(x_TD[t] @ moe.gate_proj[e]) * (x_TD[t] @ moe.up_proj[e])
                        ) @ moe.down_proj[e]
    out.append(sum(w[i] * expert(top[i]) for i in range(K)))
  return jnp.stack(out)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_grouped_experts_equal_the_per_token_reference_with_gradients(norm_topk):
  moe = _moe(norm_topk)
  x = jax.random.normal(jax.random.key(3), (2, 5, 8))
  out, _ = moe(x)
  np.testing.assert_allclose(out.reshape(10, 8), _reference(moe, x.reshape(10, 8)), rtol=1e-5,
                             atol=1e-6)
  graphdef, state = nnx.split(moe)
  loss = lambda s, fn: (fn(nnx.merge(graphdef, s), x) ** 2).sum()
  grads = jax.grad(loss)(state, lambda m, x: m(x)[0])
  ref = jax.grad(loss)(state, lambda m, x: _reference(m, x.reshape(10, 8)))
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_router_losses_follow_the_pooled_formula_and_skip_uncounted_rows():
  moe = _moe(False)
  x = jax.random.normal(jax.random.key(4), (1, 6, 8))
  counted = jnp.array([[1, 1, 1, 1, 0, 0]])
  _, stats = moe(x, counted)
  _, first4 = moe(x[:, :4])
  for key in stats:
    np.testing.assert_allclose(stats[key], first4[key], rtol=1e-6)
  layers = jax.tree.map(lambda a, b: jnp.stack([a, b]), stats, moe(x)[1])  # two "layers"
  got = router_losses(layers, E)
  logits = x[0] @ moe.router.kernel[...]
  probs = jax.nn.softmax(logits, axis=-1)
  picks = jax.nn.one_hot(jax.lax.top_k(probs, K)[1], E).sum(1)
  rows = jnp.concatenate([jnp.arange(4), jnp.arange(6)])  # layer 1 counts 4 rows, layer 2 six
  f, p = picks[rows].mean(0), probs[rows].mean(0)
  np.testing.assert_allclose(got["moe_aux_loss"], E * jnp.sum(f * p), rtol=1e-6)
  z = jnp.square(jax.nn.logsumexp(logits, axis=-1))
  np.testing.assert_allclose(got["moe_z_loss"], z[rows].mean(), rtol=1e-6)
  np.testing.assert_allclose(got["moe_max_load"], f.max() / f.mean(), rtol=1e-6)


def _cfg(strategy, **parallel):
  return replace(test_strategies._cfg(strategy, 4), model=MOE, parallel=parallel)


@functools.cache
def _one_device():
  return test_strategies._loss_and_grads(_cfg("none"), None)


@pytest.mark.slow
def test_moe_loss_and_grads_equal_one_device():
  """Router statistics are pooled over the batch, so the aux loss couples every row: it must
  still come out the same with rows split over ranks and the experts ZeRO-3 sharded (every
  strategy on seq=8: `ROUTER_CASES` and tests/objectives/test_diffusiongemma.py), and with
  each device's rows routed in 5 chunks, whose statistics meet in one psum over the data and
  seq axes (parallel/experts.py)."""
  cfg = replace(_cfg("cp_ring", data=2, fsdp=2, seq=2), model=dict(row_chunks=5))
  test_strategies.assert_close(*test_strategies._loss_and_grads(cfg, make_mesh(cfg)),
                               *_one_device())


# Router losses on (the aux weight is Qwen3-MoE's default router_aux_loss_coef, and a z-loss):
# bp, which replicates the clean prefix and leaves out the last clean block, on both diffusion
# objectives and both MoE families; cp_ring on ar. (Every other strategy runs with router
# losses on in tests/objectives/test_diffusiongemma.py.)
FAMILIES = {"all_moe": {}, "mixed": dict(mlp_pattern="dense,moe")}
ROUTER_CASES = [("bp", "bd3lm", "all_moe"), ("bp", "fast_dllm_v2", "mixed"),
                ("cp_ring", "ar", "mixed")]


def _router_cfg(strategy, objective, family, **parallel):
  model = dict(MOE, moe_aux_weight=0.001, moe_z_weight=1e-3, **FAMILIES[family])
  return replace(test_strategies._cfg(strategy, 6, objective), model=model, parallel=parallel)


def _router_batch():
  """Packed documents, prompts and padding shorter than a block, so the last block's clean
  rows hold real tokens."""
  L = test_strategies.L
  rng = np.random.default_rng(8117)
  seg = np.sort(rng.integers(1, 4, (4, L)), axis=1)
  seg[:, -2:] = 0
  return rng.integers(0, 250, (4, L)), seg, rng.random((4, L)) < 0.25


@functools.cache
def _router_reference(objective, family):
  return test_strategies._loss_and_grads(_router_cfg("none", objective, family), None,
                                         _router_batch(), seed=4242)


def test_router_cases_cover_every_strategy():
  """Here, or with router losses on in tests/objectives/test_diffusiongemma.py."""
  from tests.objectives import test_diffusiongemma  # (it imports this module's neighbours)
  covered = {case[0] for case in ROUTER_CASES} | {s for s, _ in test_diffusiongemma.STRATEGIES}
  # (a drafter-only strategy has no MoE: the drafter is dense)
  assert covered == set(strategy_names(splits_sequences=True, needs_drafter=False))
  assert test_diffusiongemma.MODEL["moe_aux_weight"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy,objective,family", ROUTER_CASES)
def test_router_losses_count_each_row_once_under_every_strategy(strategy, objective, family):
  """The load-balancing and z losses pool every counted row of the step; a strategy that
  holds a row twice, or not at all, must not change them: loss and every gradient equal
  one device's."""
  cfg = _router_cfg(strategy, objective, family, seq=8)
  got = test_strategies._loss_and_grads(cfg, make_mesh(cfg), _router_batch(), seed=4242)
  test_strategies.assert_close(*got, *_router_reference(objective, family))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s documented semantics from all-gathers, for XLA:CPU, which
  cannot run the real one: sender i's rows operand_i[input_offsets_i[j] : + send_sizes_i[j]]
  land in member j's output at output_offsets_i[j]."""
  del recv_sizes
  every = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                      output_offsets)]
  operand_G, in_off_GG, send_GG, out_off_GG = every
  me, slot = jax.lax.axis_index(axis_name), jnp.arange(output.shape[0])
  for i in range(operand_G.shape[0]):
    lo, n, src = out_off_GG[i, me], send_GG[i, me], in_off_GG[i, me]
    rows = jnp.clip(src + slot - lo, 0, operand.shape[0] - 1)
    output = jnp.where(((slot >= lo) & (slot < lo + n))[:, None], operand_G[i][rows], output)
  return output


# Expert parallelism on three meshes, csbp_ring, cp_ring and bp, both dispatches (the ragged one
# emulated): E = 4 experts over G = 4 devices (one each) or 2 (two each). On csbp_ring each
# device routes its rows in 5 chunks (model.row_chunks; 5 of 48 rows, the last one shorter),
# each chunk exchanged on its own; elsewhere all at once.
EXPERT_PARALLEL = [
    ("csbp_ring", dict(data=2, fsdp=2, seq=2, expert_axes="data,fsdp"), "all_gather"),
    ("cp_ring", dict(fsdp=4, seq=2, expert_axes="fsdp"), "all_gather"),
    ("csbp_ring", dict(fsdp=2, seq=4, expert_axes="seq"), "ragged_all_to_all"),
    ("cp_ring", dict(data=2, fsdp=2, seq=2, expert_axes="seq"), "ragged_all_to_all"),
    ("bp", dict(data=2, fsdp=2, seq=2, expert_axes="fsdp,seq"), "all_gather"),  # replicated rows
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh_shape,dispatch", EXPERT_PARALLEL)
def test_expert_parallel_loss_and_grads_equal_one_device(strategy, mesh_shape, dispatch,
                                                         monkeypatch):
  """Tokens travel to the devices holding their experts and back; the expert weights, their
  gradients and Adam moments stay split over the expert axes. Dispatched in row chunks, every
  pair is still routed: the same loss and gradients."""
  if dispatch == "ragged_all_to_all":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  cfg = _cfg(strategy, moe_dispatch=dispatch, **mesh_shape)
  if strategy == "csbp_ring":
    cfg = replace(cfg, model=dict(row_chunks=5))
  mesh = make_mesh(cfg)
  test_strategies.assert_close(*test_strategies._loss_and_grads(cfg, mesh), *_one_device())
  params = init_params(cfg, jax.random.key(0), mesh)
  axes = tuple(mesh_shape["expert_axes"].split(","))
  gate = params["layers"]["mlp"]["gate_proj"]
  split = gate.sharding.spec[1]  # [layers, E, D, F]: E split over the expert axes
  assert (split if isinstance(split, tuple) else (split,)) == axes
  assert gate.addressable_shards[0].data.shape[1] == E // np.prod([mesh.shape[a] for a in axes])


def test_ragged_dispatch_lowers_to_ragged_all_to_all_there_and_back():
  """The default dispatch: one ragged all-to-all to the experts and one back per layer, the
  backward's two more; no all-gather of rows. (XLA:CPU compiles but cannot run it.)"""
  cfg = _cfg("csbp_ring", data=2, fsdp=2, seq=2, expert_axes="data,fsdp")
  mesh = make_mesh(cfg)
  batch = make_batch(cfg, *test_strategies._logical_batch())
  params = init_params(cfg, jax.random.key(0), mesh)
  step = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]))
  text = step.lower(params).as_text()
  assert text.count("ragged_all_to_all") == 4  # forward there and back, and their transposes


def _received_rows(cfg):
  """The rows of each ragged all-to-all's output buffer in the lowered step (forward there
  and back, and their transposes; a chunk loop's first chunk, its rematerialised forward and
  its tail outside the loop)."""
  mesh = make_mesh(cfg)
  batch = make_batch(cfg, *test_strategies._logical_batch())
  params = init_params(cfg, jax.random.key(0), mesh)
  step = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]))
  return set(re.findall(r"ragged_all_to_all.*-> tensor<(\d+)x", step.lower(params).as_text()))


@pytest.mark.slow
def test_dropless_dispatch_in_row_chunks_receives_a_chunks_pairs():
  """G = 4 devices of 2 x 48 rows, k = 2: a device may receive every pair of the group, 768
  rows at once; in 5 chunks, 4 x 2 x 10 x 2 = 160 a chunk of 10 rows (128 the last, of 8).
  (The pairs' outputs come back into 2 x 48 x 2 = 192 rows, 40 a chunk, 32 the last.)"""
  cfg = _cfg("csbp_ring", fsdp=2, seq=4, expert_axes="seq")
  assert _received_rows(cfg) == {"768", "192"}
  assert _received_rows(replace(cfg, model=dict(row_chunks=5))) == {"160", "128", "40", "32"}


def test_a_dispatch_the_backend_cannot_run_is_refused_before_training(tmp_path):
  cfg = replace(tiny_config(steps=1), model=MOE, parallel=dict(seq=2, strategy="csbp_ring",
                                                               expert_axes="seq"))
  with pytest.raises(ConfigError, match="set parallel.moe_dispatch=all_gather"):
    loop.train(cfg, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_capacity_drops_the_pairs_over_it_in_order_and_counts_them():
  """An expert keeps its first ceil(factor * T * k / E) pairs in token order; a dropped pair
  adds nothing; the stats count what was dropped."""
  moe = _moe(False)
  moe.cfg = dataclasses.replace(moe.cfg, moe_drop_tokens=True, moe_capacity_factor=0.5)
  x = jax.random.normal(jax.random.key(5), (1, 12, 8))
  out, stats = moe(x)
  x_TD = x[0]
  probs = jax.nn.softmax(x_TD @ moe.router.kernel[...], axis=-1)
  top_w, top_e = jax.lax.top_k(probs, K)
  cap = int(np.ceil(0.5 * 12 * K / E))
  seen, ref, dropped = {e: 0 for e in range(E)}, [], 0
  for t in range(12):
    acc = 0
    for i in range(K):
      e = int(top_e[t, i])
      seen[e] += 1
      if seen[e] > cap:
        dropped += 1
        continue
      acc = acc + top_w[t, i] * ((jax.nn.silu(x_TD[t] @ moe.gate_proj[e])
                                  * (x_TD[t] @ moe.up_proj[e])) @ moe.down_proj[e])
    ref.append(acc * jnp.ones(8))
  assert dropped > 0
  np.testing.assert_allclose(out[0], jnp.stack(ref), rtol=1e-5, atol=1e-6)
  assert float(stats["dropped"]) == dropped
  stacked = jax.tree.map(lambda a: a[None], stats)
  assert float(router_losses(stacked, E)["moe_dropped"]) == pytest.approx(dropped / (12 * K))


@pytest.mark.slow
def test_expert_parallel_capacity_counts_the_groups_tokens():
  """With a capacity, expert parallelism over every device holding rows drops exactly what
  one device holding the whole batch drops: the same queue (members in sequence order), so
  the same loss too; row chunks do not cut the queue (every row is routed at once)."""
  drop = dict(moe_drop_tokens=True, moe_capacity_factor=0.6)
  cfg = replace(_cfg("none", data=2, fsdp=2, expert_axes="data,fsdp",
                     moe_dispatch="all_gather"), model=dict(row_chunks=3, **drop))
  one = replace(_cfg("none"), model=drop)
  batch = make_batch(cfg, *test_strategies._logical_batch())
  mesh = make_mesh(cfg)
  got = loss_fn(init_params(cfg, jax.random.key(0), mesh), batch, jax.random.key(1), cfg, mesh)
  ref = loss_fn(init_params(one, jax.random.key(0)), batch, jax.random.key(1), one)
  assert float(ref[1]["moe_dropped"]) > 0.05
  for key in ("moe_dropped", "loss"):
    np.testing.assert_allclose(got[1][key], ref[1][key], rtol=1e-5)


MIXED = dict(n_layers=5, mlp_pattern="dense,moe", layer_pattern="local,global", sliding_window=8)


def assert_scan_equals_layer_loop(cfg, params):
  """The model's scanned forward equals a plain loop over its layers, each read from its
  stack (`layer_slots`), on a corrupted `_logical_batch`; returns (inputs, router stats)."""
  batch = make_batch(cfg, *test_strategies._logical_batch())
  batch, inputs, *_ = get_objective("bd3lm").corrupt(jax.random.key(1), batch, cfg)
  model, attend = merge(cfg, params), make_attend(cfg, None)
  hidden, stats = model.forward(inputs, batch.pos, batch.meta, attend)
  x = model.embed_tokens(inputs)
  for (stack, index), kind in zip(layer_slots(cfg.model), layer_types(cfg.model)):
    graphdef, state = nnx.split(getattr(model, stack))
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))
    x, _ = block(x, batch.pos, batch.meta, attend, kind)
  np.testing.assert_allclose(hidden, model.final_norm(x), rtol=1e-5, atol=1e-5)
  return inputs, stats


@pytest.mark.slow
def test_mixed_dense_and_moe_layers_scan_like_a_loop_over_the_layers():
  """MLPs dense,moe,moe under local,global attention over 7 layers: the patterns repeat
  every 6 layers (their lcm, not the longer one's 3); the scanned period and the remainder
  take each layer's weights from its own stack (MoE layers in `layers`, dense ones in
  `dense_layers`), as a plain loop over the layers does; router statistics come from the MoE
  layers only."""
  cfg = replace(_cfg("none"), model=dict(MIXED, n_layers=7, mlp_pattern="dense,moe,moe"))
  params = init_params(cfg, jax.random.key(0))
  assert params["layers"]["mlp"]["gate_proj"].shape[:2] == (4, E)
  assert params["dense_layers"]["mlp"]["gate_proj"]["kernel"].shape[0] == 3
  inputs, stats = assert_scan_equals_layer_loop(cfg, params)
  rows = inputs.size
  assert stats["tokens"].tolist() == [0, rows, rows, 0, rows, rows, 0]


@pytest.mark.slow
def test_mixed_layers_with_expert_parallelism_equal_one_device():
  cfg = _cfg("csbp_ring", data=2, fsdp=2, seq=2, expert_axes="data,fsdp",
             moe_dispatch="all_gather")
  one = replace(_cfg("none"), model=MIXED)
  test_strategies.assert_close(
      *test_strategies._loss_and_grads(replace(cfg, model=MIXED), make_mesh(cfg)),
      *test_strategies._loss_and_grads(one, None))


def test_each_device_routes_only_its_own_rows():
  """Plain jit would sort the whole batch's (token, expert) pairs on every device (measured:
  s32[1536] here); under the dispatch each device sorts its own 4 x 24 rows' 192 pairs."""
  cfg = _cfg("csbp_ring", seq=8)
  mesh = make_mesh(cfg)
  batch = make_batch(cfg, *test_strategies._logical_batch())
  params = init_params(cfg, jax.random.key(0), mesh)
  step = jax.jit(jax.grad(lambda p: loss_fn(p, batch, jax.random.key(1), cfg, mesh)[0]))
  text = step.lower(params).compile().as_text()
  local_pairs = batch.tokens.size // mesh.size * K
  assert set(re.findall(r"= \(?s32\[(\d+)\][^=]*? sort\(", text)) == {str(local_pairs)}


def test_training_logs_the_router(tmp_path, monkeypatch):
  """In metrics.jsonl and TensorBoard, with capacity dropping on. A zero router gives figures
  worked by hand: every token's probabilities are 1/E and its top-2 are experts 0 and 1 (ties
  go to the lower index), so f = (1, 1, 0, 0), aux = E * sum_e f_e / E = 2, max load =
  1 / mean f = 2, z = log(E)^2. Experts 0 and 1 each keep the pairs of the first
  C = ceil(0.5 * T * 2 / 4) = T / 4 of the T rows, so the dropped share is that of the counted
  rows (real, and not the last block's clean rows: `LayoutPlan.counted_rows`) after the first
  C. Logged at step 1, before any update."""
  from bdlm_jax.feed import Feed
  from bdlm_jax.train import init_state

  def zero_router(cfg, key, mesh, params=None):
    params = init_params(cfg, key, mesh)
    router = params["layers"]["mlp"]["router"]
    router["kernel"] = jnp.zeros_like(router["kernel"])
    return init_state(cfg, key, mesh, params)

  monkeypatch.setattr(loop, "init_state", zero_router)
  cfg = replace(tiny_config(steps=1), model=dict(MOE, moe_drop_tokens=True,
                                                 moe_capacity_factor=0.5))
  loop.train(cfg, str(tmp_path), progress=False)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    row, = [json.loads(line) for line in f]
  assert row["moe_aux_loss"] == pytest.approx(2.0, rel=1e-6)
  assert row["moe_max_load"] == pytest.approx(2.0, rel=1e-6)
  assert row["moe_z_loss"] == pytest.approx(np.log(E) ** 2, rel=1e-6)
  seg = np.asarray(next(Feed(cfg, make_mesh(cfg))).seg)  # the first batch
  counted_T = ((seg > 0) & plan_for(cfg).counted_rows[None]).reshape(-1)
  dropped = counted_T[counted_T.size // 4:].sum() / counted_T.sum()
  assert 0.7 < dropped <= 0.75 and row["moe_dropped"] == pytest.approx(dropped, rel=1e-6)
  events = b"".join(p.read_bytes() for p in (tmp_path / "tb").iterdir())
  assert all(tag.encode() in events for tag in ("moe_aux_loss", "moe_max_load", "moe_dropped"))
  expected = row["token_loss"] + 0.01 * row["moe_aux_loss"] + 1e-3 * row["moe_z_loss"]
  assert row["loss"] == pytest.approx(expected, rel=1e-5)


def test_more_experts_per_token_than_experts_is_refused():
  with pytest.raises(ConfigError, match=r"model.moe_top_k=5 must lie in \[1, model.moe_experts=4\]"):
    override(Config(), ["model.moe_experts=4", "model.moe_top_k=5"])


@pytest.mark.parametrize("settings,message", [
    (["parallel.fsdp=4", "parallel.expert_axes=fsdp", "model.moe_experts=6"],
     r"model.moe_experts=6 does not divide over parallel.expert_axes='fsdp' \(4 devices\)"),
    (["parallel.expert_axes=fsdp,tensor"], r"parallel.expert_axes entry='tensor' is not one of"),
    (["parallel.expert_axes=fsdp,fsdp"], "names an axis twice"),
    (["model.moe_experts=0", "parallel.expert_axes=fsdp"], "model.moe_experts=0"),
    (["model.moe_capacity_factor=0"], r"model.moe_capacity_factor must be > 0, got 0.0"),
    (["parallel.moe_dispatch=nccl"], r"parallel.moe_dispatch='nccl' is not one of"),
    (["model.mlp_pattern=dense,sparse"], r"model.mlp_pattern='dense,sparse' has the MLP type "
                                         r"'sparse'; valid types: \['dense', 'moe'\]"),
    (["model.mlp_pattern=dense"], r"model.moe_experts=4, but model.mlp_pattern='dense' gives none"),
    (["model.moe_experts=0", "model.mlp_pattern=dense,moe"], r"has MoE layers, but "
                                                             r"model.moe_experts=0"),
])
def test_bad_expert_settings_are_refused(settings, message):
  with pytest.raises(ConfigError, match=message):
    override(Config(), ["model.moe_experts=4", *settings])


def test_model_flops_count_the_router_and_the_k_experts_a_row_uses():
  """What MFU counts: a row pays for its k experts (as a dense MLP k times as wide) and the
  router, never for all E experts."""
  cfg = _cfg("none")
  dense = replace(cfg, model=dict(moe_experts=0, d_ff=K * MOE["moe_d_ff"]))
  rows = 3 * cfg.train.batch_size * 2 * cfg.data.seq_len * cfg.model.n_layers  # fwd + bwd
  router = rows * 2 * cfg.model.d_model * E
  assert model_flops_per_step(cfg) - model_flops_per_step(dense) == pytest.approx(router)
