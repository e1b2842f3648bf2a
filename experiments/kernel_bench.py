"""Attention kernels on BDLM masks: the pallas kernel against cuDNN, tokamax and the xla path.

  python experiments/kernel_bench.py                 # GPU: L 8K..64K, B 16..256 (+ causal rows)
  python experiments/kernel_bench.py --lens 8192 --blocks 16 --budget-s 240   # a short GPU check
  python experiments/kernel_bench.py --quick         # any backend (automatic on CPU): pallas vs
                                                     # xla correctness on small shapes
  python experiments/kernel_bench.py --sweep-tiles --lens 16384 --blocks 16   # GPU: pallas tile
                                                     # sizes and Triton settings on one case
  python experiments/kernel_bench.py --tile-report --lens 8192 --blocks 16 256   # NumPy: tiles
                                                     # each strategy's kernel calls visit

One sequence, the BDLM training stream `[x_t ; x_0]` of 2L rows in logical order, GQA 32/8
heads, head dim 128, bf16. For each kernel: forward, and forward+backward (jax.vjp), median
wall time and *useful* TFLOP/s, counting only the allowed (query, key) pairs: 4 D Hq flops per
pair forward, 14 D Hq forward+backward (the backward's 5 matmuls). Peers:
  pallas   bdlm_jax.kernels.pallas, tile skipping from the mask's block-sparse map
  cudnn    jax.nn.dot_product_attention(implementation='cudnn') with the BDLM mask as a dense
           additive bias [2L, 2L] (cuDNN cannot express it otherwise; no tile skipping); sizes
           whose bias does not fit in half the device memory are skipped, with the reason
  tokamax  tokamax.dot_product_attention (mosaic, then triton) with the dense boolean mask,
           if tokamax imports (it is not in the GPU image unless a wheel is carried)
  xla      bdlm_jax.kernels.xla, the key-chunked jnp path (computes every pair)
Every peer builds what its kernel reads from the row metadata inside the timed function, as a
training step does (`mask_built` = in step: Pallas its tile map, cuDNN and tokamax their dense
mask); cuDNN and tokamax are also timed with the dense mask built once outside (`mask_built` =
outside: the kernel alone). Causal rows (plain causal attention over 2L tokens; cuDNN and
tokamax use their native causal masks) are the sanity check. Every peer runs in try/except and
prints why it was skipped. `err_vs_pallas` is the max |out - out_pallas| of the forward output.
Rows append to the CSV as they finish (experiments/results/kernel_bench.csv), so a run cut
short keeps its rows; the table prints last.
"""

import argparse
import csv
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax.kernels import pallas, tiles, xla
from bdlm_jax.kernels.mask import RowMeta, allowed
from bdlm_jax.parallel.registry import SINGLE_DEVICE, get_strategy, make_plan, strategy_names

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FIELDS = ["mask", "L", "B", "rows", "peer", "tiles", "mask_built", "mode", "ms", "useful_tflops",
          "allowed_fraction", "visited_tile_fraction", "err_vs_pallas", "note"]
DENSE_PEERS = ("cudnn", "tokamax")  # a BDLM mask reaches them as a dense [2L, 2L] array
# --sweep-tiles: pallas tile sizes (forward q x k, backward q x k) and Triton warps / stages.
TILE_SWEEP = [pallas.Tiles(128, 64, 64, 64), pallas.Tiles(128, 64, 64, 64, 4),
              pallas.Tiles(128, 64, 64, 64, 8, 3), pallas.Tiles(128, 128, 64, 64),
              pallas.Tiles(64, 64, 64, 64), pallas.Tiles(128, 64, 128, 64),
              pallas.Tiles(128, 64, 64, 128), pallas.Tiles(128, 64, 128, 128),
              pallas.Tiles(128, 64, 32, 64), pallas.Tiles(128, 64, 64, 32)]
FLOPS_PER_PAIR = {"fwd": 4, "fwd+bwd": 14}  # x head_dim x query heads


class Skip(Exception):
  """A peer that cannot run this case; the message says why."""


def case_plan(mask: str, seq_len: int, block: int):
  """One device's plan: the BDLM stream of 2L rows, or 2L causal (autoregressive) rows."""
  if mask == "bdlm":
    return make_plan(SINGLE_DEVICE, seq_len, block, 1)
  return make_plan(SINGLE_DEVICE, 2 * seq_len, 1, 1, noisy_stream=False)


def case_meta(mask: str, seq_len: int, block: int) -> RowMeta:
  """NumPy RowMeta [1, rows] of `case_plan`."""
  return tiles.plan_row_meta(case_plan(mask, seq_len, block))


def device_bytes() -> float:
  try:
    return float(jax.devices()[0].memory_stats()["bytes_limit"])
  except Exception:  # noqa: BLE001 (no memory stats on this backend)
    return float("inf")


def peer_fns(peer: str, mask: str, meta: RowMeta, tiles=None, prebuilt: bool = False):
  """(`fn(q, k, v, *extra) -> out`, extra) of `peer` for this mask (raises Skip with a reason).

  The metadata is an argument of the timed function, never a constant of its program (XLA
  could fold a mask or tile map built from a constant away, and embed GBs of a dense one):
  each peer builds what its kernel reads from it inside the timed function, as a training
  step does, Pallas its tile map and cuDNN / tokamax their dense mask. `prebuilt`: a dense
  peer's mask is built once, outside, to time its kernel alone (Pallas has no such variant:
  it builds its tile map inside `attend`)."""
  meta_j = RowMeta(*(jnp.asarray(x) for x in meta))
  if peer == "pallas":
    return lambda q, k, v, m: pallas.attend(q, k, v, m, m, tiles=tiles)[0], (meta_j,)
  if peer == "xla":
    return lambda q, k, v, m: xla.attend(q, k, v, m, m, 512)[0], (meta_j,)
  if jax.default_backend() != "gpu":
    raise Skip("needs a GPU")
  rows = meta.seg.shape[1]
  if peer == "cudnn":
    if mask == "causal":
      return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                          implementation="cudnn"), ()
    need = rows * rows * 2
    if need > device_bytes() / 2:
      raise Skip(f"dense bias of {need / 2**30:.0f} GiB does not fit in half the device memory")
    dense = lambda m: jnp.where(allowed(m, m), 0.0, -1e9).astype(jnp.bfloat16)[:, None]
    fn = lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias=bias,
                                                            implementation="cudnn")
  elif peer == "tokamax":
    try:
      import tokamax
    except Exception as e:  # noqa: BLE001
      raise Skip(f"tokamax does not import: {type(e).__name__}: {e}") from None
    if mask == "causal":
      return lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=True, implementation=("mosaic", "triton")), ()
    if rows * rows > device_bytes() / 2:
      raise Skip(f"dense mask of {rows * rows / 2**30:.0f} GiB does not fit")
    dense = lambda m: allowed(m, m)[:, None]
    fn = lambda q, k, v, mask: tokamax.dot_product_attention(
        q, k, v, mask=mask, implementation=("mosaic", "triton"))
  else:
    raise ValueError(f"unknown peer {peer!r}")
  if prebuilt:
    return fn, (jax.jit(dense)(meta_j),)
  return lambda q, k, v, m: fn(q, k, v, dense(m)), (meta_j,)


def mask_built(peer: str, mask: str, prebuilt: bool) -> str:
  """Where a timed row's mask came from: built from the metadata in the timed function,
  built once outside it, or a kernel's native causal mask."""
  if mask == "causal" and peer in DENSE_PEERS:
    return "native causal"
  return "outside" if prebuilt else "in step"


def timed(fn, args, reps: int):
  """(median ms, output) of a jitted fn, compiled and run once before timing."""
  compiled = jax.jit(fn).lower(*args).compile()
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), out


def with_backward(fwd):
  def fwd_bwd(q, k, v, dout, *extra):
    out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, *extra), q, k, v)
    return vjp(dout)
  return fwd_bwd


def tiles_label(t: pallas.Tiles) -> str:
  return f"{t.fwd_q}x{t.fwd_k}/{t.bwd_q}x{t.bwd_k} w{t.num_warps or 'auto'} s{t.num_stages}"


def run_case(mask, seq_len, block, heads, dtype, peers, reps, writer, deadline):
  """Times each (peer, pallas tiles or None) of `peers` on one mask, forward and fwd+bwd; a
  dense peer on a BDLM mask twice, its mask built in the timed function and outside it."""
  hq, hkv, d = heads
  plan = case_plan(mask, seq_len, block)
  meta = tiles.plan_row_meta(plan)
  rows = meta.seg.shape[1]
  pairs = int(plan.attention_work().sum())
  vis = ""
  if mask == "bdlm":
    tile = pallas.GPU_TILES
    vis = round(tiles.visited_tiles(plan, "local", tile.fwd_q, tile.fwd_k)["visited_fraction"], 4)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, rows, hq, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(1, rows, hkv, d)), dtype) for _ in range(2))
  dout = jnp.asarray(rng.normal(size=q.shape), dtype)
  reference = None
  for peer, tile_set in peers:
    for prebuilt in (False, True) if peer in DENSE_PEERS and mask == "bdlm" else (False,):
      try:
        (fwd, extra), why_not = peer_fns(peer, mask, meta, tile_set, prebuilt), ""
      except Skip as e:
        fwd, why_not = None, f"skipped: {e}"
      except Exception as e:  # noqa: BLE001 (building a dense mask can fail, e.g. out of memory)
        fwd, why_not = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
      for mode in ("fwd", "fwd+bwd"):
        row = dict(mask=mask, L=seq_len, B=block if mask == "bdlm" else "", rows=rows,
                   peer=peer, tiles=tiles_label(tile_set or pallas.default_tiles(
                       dtype, pallas.interpret_mode())) if peer == "pallas" else "",
                   mask_built=mask_built(peer, mask, prebuilt), mode=mode,
                   allowed_fraction=round(pairs / rows**2, 4), visited_tile_fraction=vis,
                   ms="", useful_tflops="", err_vs_pallas="", note=why_not)
        if fwd is not None and time.time() > deadline:
          row["note"] = "skipped: time budget spent (--budget-s)"
        elif fwd is not None:
          try:
            if mode == "fwd":
              ms, out = timed(fwd, (q, k, v, *extra), reps)
              out = np.asarray(out, np.float32)
              if reference is None and peer == "pallas":
                reference = out
              elif reference is not None:
                row["err_vs_pallas"] = f"{np.abs(out - reference).max():.3g}"
            else:
              ms, _ = timed(with_backward(fwd), (q, k, v, dout, *extra), reps)
            row["ms"] = f"{ms:.3f}"
            row["useful_tflops"] = f"{FLOPS_PER_PAIR[mode] * pairs * d * hq / ms / 1e9:.1f}"
          except Exception as e:  # noqa: BLE001 (one failing peer must not stop the others)
            row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc(limit=3)
        print(" ".join(f"{key}={row[key]}" for key in FIELDS if row[key] != ""), flush=True)
        writer(row)


def quick_check(dtypes=("float32", "bfloat16")):
  """Pallas vs xla on small BDLM and causal shapes: max relative error of out and grads."""
  print("quick correctness pass: pallas (interpret mode on CPU) vs xla", flush=True)
  worst = {}
  for mask, seq_len, block in [("bdlm", 64, 4), ("bdlm", 128, 16), ("causal", 64, 1)]:
    meta = RowMeta(*(jnp.asarray(x) for x in case_meta(mask, seq_len, block)))
    rows = meta.seg.shape[1]
    for dtype in dtypes:
      rng = np.random.default_rng(1)
      q = jnp.asarray(rng.normal(size=(2, rows, 4, 16)), dtype)
      k, v = (jnp.asarray(rng.normal(size=(2, rows, 2, 16)), dtype) for _ in range(2))
      meta2 = RowMeta(*(jnp.concatenate([x, x]) for x in meta))
      results = {}
      for name, impl in (("pallas", pallas), ("xla", xla)):
        fwd = lambda q, k, v, impl=impl: impl.attend(q, k, v, meta2, meta2, 32)[0]
        grads = jax.jit(with_backward(fwd))(q, k, v, q)
        results[name] = [np.asarray(x, np.float32) for x in (jax.jit(fwd)(q, k, v), *grads)]
      errs = [np.abs(a - b).max() / np.abs(b).max() for a, b in zip(results["pallas"],
                                                                    results["xla"])]
      worst[dtype] = max(worst.get(dtype, 0.0), *errs)
      print(f"  {mask} L={seq_len} B={block} {dtype}: rel err out {errs[0]:.2e}, dq {errs[1]:.2e},"
            f" dk {errs[2]:.2e}, dv {errs[3]:.2e}", flush=True)
  return worst


def tile_report(lens=(8192, 65536), blocks=(16, 256), num_ranks=8, window=1024):
  """Visited-tile vs allowed-pair fractions of every strategy's kernel calls (NumPy only), on
  a global layer and on a local layer of `window` positions."""
  from bdlm_jax.parallel.strategies import exchange_for, window_transport
  tq, tk = pallas.GPU_TILES.fwd_q, pallas.GPU_TILES.fwd_k
  print(f"tile map ({tq}x{tk} forward tiles): visited fraction of tiles vs allowed fraction of "
        f"pairs, per strategy (P={num_ranks}), global and local (W={window}) layers")
  for seq_len in lens:
    for block in blocks:
      for strategy in strategy_names(needs_drafter=False):
        record = get_strategy(strategy)
        plan = make_plan(strategy, seq_len, block, num_ranks if record.splits_sequences else 1)
        local = window_transport(plan, window)
        exchange = exchange_for(plan, window) if local == "exchange" else None
        for layer, r in (("global", tiles.visited_tiles(plan, record.transport, tq, tk)),
                         ("local", tiles.visited_tiles(plan, local, tq, tk, window, exchange))):
          print(f"  L={seq_len} B={block} {strategy:15s} {layer:6s} visited "
                f"{r['visited_fraction']:.4f} allowed {r['allowed_fraction']:.4f} "
                f"full {r['full'] / r['total']:.4f}", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small correctness pass (default on CPU)")
  ap.add_argument("--lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
  ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
  ap.add_argument("--peers", nargs="+", default=["pallas", "cudnn", "tokamax", "xla"])
  ap.add_argument("--xla-max-len", type=int, default=16384,
                  help="skip the xla path (every pair, O(L^2) time) above this L")
  ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128],
                  metavar=("HQ", "HKV", "D"), help="query heads, K/V heads, head dim")
  ap.add_argument("--sweep-tiles", action="store_true",
                  help="pallas only, one BDLM case (the first --lens and --blocks), over the\n"
                       "tile sizes and Triton settings of TILE_SWEEP")
  ap.add_argument("--tile-report", action="store_true",
                  help="NumPy only, any backend: visited vs allowed tiles of every strategy's\n"
                       "kernel calls, global and local layers, for --lens x --blocks")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=480.0,
                  help="stop starting new measurements after this many seconds")
  ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "kernel_bench.csv"))
  args = ap.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}",
        flush=True)
  if args.tile_report:
    tile_report(lens=args.lens, blocks=args.blocks)
    return
  if args.quick or jax.default_backend() != "gpu":
    tile_report(lens=(8192,))
    worst = quick_check()
    # On GPU both kernels multiply float32 in TF32 (about 3e-4 relative), as XLA does by default.
    f32_bar = 1e-5 if pallas.interpret_mode() else 1e-3
    ok = worst["float32"] < f32_bar and worst["bfloat16"] < 2e-2
    print(f"worst relative error: {worst} -> {'OK' if ok else 'MISMATCH'}")
    sys.exit(0 if ok else 1)

  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  rows = []

  def write(row):
    rows.append(row)
    with open(args.out, "w", newline="") as f:
      w = csv.DictWriter(f, FIELDS)
      w.writeheader()
      w.writerows(rows)

  deadline = time.time() + args.budget_s
  if args.sweep_tiles:
    run_case("bdlm", args.lens[0], args.blocks[0], args.heads, jnp.bfloat16,
             [("pallas", t) for t in TILE_SWEEP], args.reps, write, deadline)
  else:
    cases = [("causal", n, 1) for n in args.lens[:1]]
    cases += [("bdlm", n, b) for n in args.lens for b in args.blocks]
    cases += [("causal", n, 1) for n in args.lens[1:]]
    for mask, seq_len, block in cases:
      peers = [(p, None) for p in args.peers if p != "xla" or seq_len <= args.xla_max_len]
      run_case(mask, seq_len, block, args.heads, jnp.bfloat16, peers, args.reps, write, deadline)
  print(f"\nwrote {args.out}\n")
  widths = {f: max(len(f), *(len(str(r[f])) for r in rows)) for f in FIELDS}
  print("  ".join(f.ljust(widths[f]) for f in FIELDS))
  for r in rows:
    print("  ".join(str(r[f]).ljust(widths[f]) for f in FIELDS))


if __name__ == "__main__":
  main()
