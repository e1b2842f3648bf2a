"""The pallas attention (interpret mode on CPU) against the xla oracle, and its tile map.

Interpret mode compiles slowly, so every kernel test reuses a few fixed shapes: metadata are
traced values, and different masks (documents, padding, every strategy's ring steps) are just
different metadata for one compiled kernel.
"""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import get_kernel, pallas, tiles, xla
from bdlm_jax.kernels.mask import CLEAN, NOISY, NOISY_CAUSAL, RowMeta, allowed
from bdlm_jax.kernels.xla import NEG_INF
from bdlm_jax.parallel.registry import make_plan
from bdlm_jax.parallel.registry import STRATEGIES, strategy_names
from tests.kernels import test_xla

BDLM_STRATEGIES = strategy_names(needs_drafter=False)  # those with a plan of [x_t ; x_0]


def random_meta(rng, s, r, n_blocks=4, n_segs=3):
  """Sorted blocks (as in real layouts, so some tiles are FULL or EMPTY), random streams,
  documents and windows (test_xla.random_meta); seg 0 rows are padding."""
  return test_xla.random_meta(rng, s, r, n_blocks, n_segs,
                              blocks=np.sort(rng.integers(0, n_blocks, (s, r)), axis=1))


@functools.partial(jax.jit, static_argnums=0)
def fwd_bwd(impl, q, k, v, q_meta, k_meta, dout, dlse):
  out, lse = impl.attend_fwd(q, k, v, q_meta, k_meta, 16)
  return out, lse, impl.attend_bwd(q, k, v, q_meta, k_meta, out, lse, dout, dlse, 16)


def rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def assert_matches_xla(q, k, v, q_meta, k_meta, tol, seed=0, impl=pallas):
  """`impl`'s out, lse, dq, dk and dv within `tol` (relative) of the xla oracle's."""
  rng = np.random.default_rng(seed)
  dout = jnp.asarray(rng.normal(size=q.shape), q.dtype)
  dlse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
  out, lse, grads = fwd_bwd(impl, q, k, v, q_meta, k_meta, dout, dlse)
  up = lambda x: x.astype(jnp.float32)  # the oracle runs in f32 on the same (rounded) inputs
  ref_out, ref_lse, ref_grads = fwd_bwd(xla, up(q), up(k), up(v), q_meta, k_meta, up(dout), dlse)
  empty = np.asarray(ref_lse) <= NEG_INF / 2
  np.testing.assert_array_equal(np.asarray(lse) <= NEG_INF / 2, empty)
  assert rel_err(out, ref_out) < tol
  assert rel_err(np.where(empty, 0, lse), np.where(empty, 0, ref_lse)) < tol
  for name, g, ref in zip("dq dk dv".split(), grads, ref_grads):
    assert np.isfinite(np.asarray(g)).all(), name
    assert rel_err(g, ref) < tol, (name, rel_err(g, ref))
  return out, grads


def inputs(seed, s=2, rq=40, rk=56, hq=8, hkv=2, d=8, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(s, rq, hq, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(s, rk, hkv, d)), dtype) for _ in range(2))
  return q, k, v, rng


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4, 8])
def test_packed_documents_padding_and_gqa_match_xla_in_f32(group):
  # 40 and 56 rows are not multiples of the 16-row tiles: the kernel pads them itself.
  q, k, v, rng = inputs(group, hkv=8 // group)
  q_meta, k_meta = random_meta(rng, 2, 40), random_meta(rng, 2, 56)
  q_meta = q_meta._replace(seg=q_meta.seg.at[1, :9].set(0))  # padding queries: attend nothing
  out, _ = assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[1, :9], 0.0)


def test_bf16_matches_f32_oracle_within_2e_2():
  q, k, v, rng = inputs(7, hkv=2, dtype=jnp.bfloat16)
  assert_matches_xla(q, k, v, random_meta(rng, 2, 40), random_meta(rng, 2, 56), tol=2e-2)


def strategy_calls(seq_len=32, block_size=4, num_ranks=2):
  """Every kernel call of every strategy (local, stay part, each ring step, all-gathered),
  plus the autoregressive (causal) stream, as one-row NumPy metadata, with three packed
  documents starting at positions 0, 3/8 L and 3/4 L (rounded down to a block)."""
  calls = []
  for strategy, noisy in [(s, True) for s in BDLM_STRATEGIES] + [("cp_ring", False)]:
    p = 1 if strategy == "none" else num_ranks
    plan = make_plan(strategy, seq_len, block_size if noisy else 1, p, noisy)
    calls += [(_documents(q, plan), _documents(k, plan))
              for q, k in tiles.kernel_calls(plan, STRATEGIES[strategy].transport)]
  return calls


def _documents(meta, plan):
  """Row metadata of a plan with three documents starting at blocks of 0, 3L/8 and 3L/4."""
  start = meta.block * plan.block_size
  doc = 1 + (start >= 3 * plan.seq_len // 8) + (start >= 3 * plan.seq_len // 4)
  return meta._replace(seg=np.where(meta.seg > 0, doc, 0))


def stack_calls(calls):
  """One batch (one compile) holding every call as a sequence, padded with padding rows."""
  rq = max(q.seg.shape[1] for q, _ in calls)
  rk = max(k.seg.shape[1] for _, k in calls)
  pad = lambda m, r: RowMeta(*(np.pad(x, ((0, 0), (0, r - x.shape[1]))) for x in m))
  stack = lambda ms, r: RowMeta(*(jnp.asarray(np.concatenate(x), jnp.int32)
                                  for x in zip(*(pad(m, r) for m in ms))))
  return stack([q for q, _ in calls], rq), stack([k for _, k in calls], rk)


def test_every_strategy_local_and_ring_step_mask_matches_xla():
  calls = strategy_calls()
  q_meta, k_meta = stack_calls(calls)
  q, k, v, _ = inputs(3, s=len(calls), rq=q_meta.seg.shape[1], rk=k_meta.seg.shape[1], hq=2,
                      hkv=1)
  assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["csbp_ring", "cp_allgather", "bp"])
def test_loss_and_grads_with_pallas_equal_xla(strategy):
  """The kernel inside each transport: the ring's steps, one all-gather, plain local rows."""
  from bdlm_jax import init_params, loss_fn, make_batch, make_mesh
  results = []
  for impl in ("xla", "pallas"):
    cfg = replace(Config(), data=dict(seq_len=32), objective=dict(block_size=4),
                  model=dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                             d_ff=64, attention_impl=impl, attention_chunk=16),
                  parallel=dict(strategy=strategy, seq=4))
    mesh = make_mesh(cfg)
    rng = np.random.default_rng(0)
    seg = np.ones((2, 32), np.int32)
    seg[0, 20:], seg[1, 28:] = 2, 0  # two documents; a padded tail
    batch = make_batch(cfg, rng.integers(0, 200, (2, 32)), seg)
    params = init_params(cfg, jax.random.key(0), mesh)
    grad_fn = jax.value_and_grad(lambda p, b, key: loss_fn(p, b, key, cfg, mesh), has_aux=True)
    (loss, _), grads = jax.jit(grad_fn)(params, batch, jax.random.key(1))
    results.append((loss, jax.tree.leaves(grads)))
  (loss_x, grads_x), (loss_p, grads_p) = results
  assert abs(float(loss_p) - float(loss_x)) < 1e-5 * abs(float(loss_x))
  assert max(rel_err(p, x) for p, x in zip(grads_p, grads_x)) < 1e-5


# ---- tile map ------------------------------------------------------------------------------

def dense_tiles(q_meta, k_meta, tq, tk):
  """(any allowed, all allowed) per tile, from the dense mask of padded metadata."""
  q_meta, k_meta = tiles.pad_meta(q_meta, tq, np), tiles.pad_meta(k_meta, tk, np)
  s, rq, rk = q_meta.seg.shape[0], q_meta.seg.shape[1], k_meta.seg.shape[1]
  m = np.asarray(allowed(q_meta, k_meta)).reshape(s, rq // tq, tq, rk // tk, tk)
  return m.any((2, 4)), m.all((2, 4))


def test_tile_map_never_skips_an_allowed_pair_nor_unmasks_a_masked_one():
  rng = np.random.default_rng(0)
  packed = (random_meta(rng, 4, 70), random_meta(rng, 4, 50))
  for q_meta, k_meta in [packed, *strategy_calls(seq_len=64, block_size=8, num_ranks=4)]:
    q_meta, k_meta = (RowMeta(*(np.asarray(x) for x in m)) for m in (q_meta, k_meta))
    kinds = tiles.tile_kinds(q_meta, k_meta, 8, 16, np)
    some, every = dense_tiles(q_meta, k_meta, 8, 16)
    assert not (some & (kinds == tiles.EMPTY)).any()
    assert not ((kinds == tiles.FULL) & ~every).any()
  # The kernel runs the same function on traced metadata.
  traced = jax.jit(tiles.tile_kinds, static_argnums=(2, 3, 4))(*packed, 8, 16, jnp)
  np.testing.assert_array_equal(traced, tiles.tile_kinds(*packed, 8, 16, np))


@pytest.mark.parametrize("strategy", BDLM_STRATEGIES)
def test_visited_tiles_of_bdlm_plans_track_allowed_pairs(strategy):
  """Bound (tiles T x T, zigzag chunks L/2P >= T): visited <= allowed * (1 + 2T/L).

  FULL tiles hold only allowed pairs and PARTIAL ones sit on block-diagonal boundaries, about
  3 per row of query tiles, hence the O(T/L) excess.
  """
  seq_len, block, tile = 1024, 16, 64
  plan = make_plan(strategy, seq_len, block, 1 if strategy == "none" else 4)
  r = tiles.visited_tiles(plan, STRATEGIES[strategy].transport, tile, tile)
  assert r["full"] * tile**2 <= r["allowed_pairs"] <= r["visited"] * tile**2
  assert r["visited_fraction"] <= r["allowed_fraction"] * (1 + 2 * tile / seq_len)
  assert r["visited_fraction"] < 0.6  # most of the (rows x rows) square is never visited


@pytest.mark.parametrize("strategy", ["none", "csbp_ring", "cp_ring"])
def test_a_local_layer_visits_only_the_tiles_its_window_reaches(strategy):
  """W = 64 of L = 1024, 16 x 16 tiles: the visited tiles hold the allowed pairs with at most
  25% to spare (1.06-1.13x measured), a sixth of what a global layer visits."""
  from bdlm_jax.parallel.strategies import exchange_for, window_transport
  seq_len, block, tile, window = 1024, 16, 16, 64
  plan = make_plan(strategy, seq_len, block, 1 if strategy == "none" else 4)
  transport = window_transport(plan, window)
  exchange = exchange_for(plan, window) if transport == "exchange" else None
  local = tiles.visited_tiles(plan, transport, tile, tile, window, exchange)
  glob = tiles.visited_tiles(plan, STRATEGIES[strategy].transport, tile, tile)
  assert local["full"] * tile**2 <= local["allowed_pairs"] <= local["visited"] * tile**2
  assert local["visited"] * tile**2 <= 1.25 * local["allowed_pairs"]
  assert local["visited"] < glob["visited"] / 4


# ---- interface, errors, GPU lowering ------------------------------------------------------

@pytest.mark.slow
def test_attention_impl_pallas_runs_the_pallas_kernel(monkeypatch):
  """`model.attention_impl=pallas` sends every attention call of the model, inside the ring,
  through kernels/pallas.py: with its forward broken there (each query's output zeroed),
  the pallas loss moves away from the xla one, and only the pallas config calls it."""
  from bdlm_jax import init_params, loss_fn, make_batch, make_mesh
  calls = []

  def broken_attend_fwd(q, k, v, q_meta, k_meta, chunk=512, into=None, tiles=None):
    calls.append(q.shape)
    out, lse = xla.attend_fwd(q, k, v, q_meta, k_meta, chunk, into)
    return jnp.zeros_like(out), lse

  monkeypatch.setattr(pallas, "attend_fwd", broken_attend_fwd)
  assert get_kernel("pallas") is pallas
  losses, called = {}, {}
  for impl in ("xla", "pallas"):
    cfg = replace(Config(), data=dict(seq_len=32), objective=dict(block_size=4),
                  model=dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                             d_ff=64, attention_impl=impl, attention_chunk=16),
                  parallel=dict(strategy="csbp_ring", seq=4))
    mesh = make_mesh(cfg)
    batch = make_batch(cfg, np.random.default_rng(0).integers(0, 200, (2, 32)))
    params = init_params(cfg, jax.random.key(0), mesh)
    calls.clear()
    losses[impl] = float(loss_fn(params, batch, jax.random.key(1), cfg, mesh)[0])
    called[impl] = len(calls)
  assert called["xla"] == 0 and called["pallas"] > 0
  assert abs(losses["pallas"] - losses["xla"]) > 1e-3 * losses["xla"]


def test_unsupported_inputs_raise_clear_errors(monkeypatch):
  q, k, v, rng = inputs(0, hq=6, hkv=4)
  meta_q, meta_k = random_meta(rng, 2, 40), random_meta(rng, 2, 56)
  with pytest.raises(ConfigError, match="multiple of K/V heads"):
    pallas.attend_fwd(q, k, v, meta_q, meta_k)
  q, k, v, _ = inputs(0, d=24)
  with pytest.raises(ConfigError, match="one dtype"):
    pallas.attend_fwd(q.astype(jnp.bfloat16), k, v, meta_q, meta_k)
  monkeypatch.setattr(pallas, "interpret_mode", lambda: False)
  with pytest.raises(ConfigError, match="power-of-two head dim"):
    pallas.attend_fwd(q, k, v, meta_q, meta_k)


def test_kernels_lower_to_triton_for_gpu(monkeypatch):
  """The GPU path traces and lowers to Triton IR (no GPU needed), for bf16, D=64, GQA 4."""
  monkeypatch.setattr(pallas, "interpret_mode", lambda: False)
  s, rq, rk = 1, 256, 192
  x = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, k, lse = x(s, rq, 8, 64), x(s, rk, 2, 64), x(s, rq, 8, dt=jnp.float32)
  qm, km = (RowMeta(*[x(s, r, dt=jnp.int32)] * len(RowMeta._fields)) for r in (rq, rk))
  for f, args in [(pallas.attend_fwd, (q, k, k, qm, km)),
                  (pallas.attend_bwd, (q, k, k, qm, km, q, lse, q, lse))]:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def test_importing_kernels_pulls_in_no_data_packages():
  code = ("import sys, bdlm_jax.kernels, bdlm_jax.kernels.pallas; "
          "print(sorted(m for m in ('grain', 'tensorboardX', 'array_record') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def test_causal_draft_queries_are_masked_by_position_in_their_block_and_never_full():
  """NOISY_CAUSAL queries (a drafter's draft rows on causal sliding layers): own-block keys at
  positions <= the query's only; their tiles are never FULL, and the kernel matches xla."""
  q, k, v, rng = inputs(1, hkv=8)  # the shapes of test_packed_documents_..._in_f32[1]
  q_meta, k_meta = random_meta(rng, 2, 40), random_meta(rng, 2, 56)
  q_meta = q_meta._replace(stream=jnp.where(q_meta.stream == NOISY, NOISY_CAUSAL, q_meta.stream))
  np_q, np_k = (RowMeta(*(np.asarray(x) for x in m)) for m in (q_meta, k_meta))
  bidirectional = np.asarray(allowed(
      np_q._replace(stream=np.where(np_q.stream == CLEAN, CLEAN, NOISY)), np_k))
  causal_q = (np_q.stream == NOISY_CAUSAL)[..., None]
  noisy_k = (np_k.stream == NOISY)[:, None, :]
  later = np_k.pos[:, None, :] > np_q.pos[..., None]
  want = bidirectional & ~(causal_q & noisy_k & later)
  assert (np.asarray(allowed(np_q, np_k)) == want).all() and (want != bidirectional).any()
  kinds = tiles.tile_kinds(np_q, np_k, 8, 16, np)
  some, every = dense_tiles(np_q, np_k, 8, 16)
  assert not (some & (kinds == tiles.EMPTY)).any()
  assert not ((kinds == tiles.FULL) & ~every).any()
  # One draft block, one document: bidirectional queries make a FULL tile, causal ones not.
  ones, pos = np.ones((1, 16), np.int32), np.arange(16, dtype=np.int32)[None]
  keys = RowMeta(ones * NOISY, ones * 0, ones, pos, pos * 0)
  for stream, kind in ((NOISY, tiles.FULL), (NOISY_CAUSAL, tiles.PARTIAL)):
    assert tiles.tile_kinds(keys._replace(stream=ones * stream), keys, 16, 16, np)[0, 0, 0] == kind
  assert_matches_xla(q, k, v, q_meta, k_meta, tol=1e-5)
