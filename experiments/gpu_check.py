"""GPU first light: one command on a GPU host checks, in at most 8 minutes, what the CPU tests
cannot, and writes one results file.

  python experiments/gpu_check.py             # a GPU host: experiments/results/gpu_check.json
  python experiments/gpu_check.py --dry-run   # the same plumbing on CPU, tiny shapes (seconds;
                                              # tests/experiments/test_gpu_check.py)

(a) configs/tiny_csbp.py on one device trains TINY_STEPS steps on fixed synthetic batches under
    model.attention_impl=xla and =pallas (on a GPU, the Triton kernel); each loss must equal
    CPU_LOSSES, recorded on XLA:CPU (`--dry-run` prints what it measures), within LOSS_RTOL.
(b) one train step of a ~1B model (Llama-3.2-1B's dimensions) on one 32K-token sequence on one
    GPU, bf16, pallas: tokens/s, MFU, and memory_stats()['peak_bytes_in_use'] beside the peak
    XLA:GPU compiled for it.
(c) Llama-3-8B at 256K over 16 GPUs, compiled (not run) by XLA:GPU under a mock topology
    (`experiments/scale_probe.py --target gpu`, one fresh process per compile, 7 minutes at
    most), csbp_ring and cp_ring, with the `xla` attention the other compilers' figures used:
    its peak next to XLA:TPU's and XLA:CPU's where results/scale_probe_tpu.csv and
    results/scale_probe.csv hold them.
(d) gpu_check.json (gpu_check_dry_run.json with --dry-run) under --out; exit 1 if a check
    failed. (c) starts first, in the background, so its compiles overlap (a) and (b).

Nothing data-side (grain, tensorboardX) is imported: the GPU image has neither.
"""

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from bdlm_jax import init_state, load_config, make_batch, make_mesh, make_train_step
from bdlm_jax.analysis.step_report import GB, compiled_memory
from bdlm_jax.config import ModelConfig
from bdlm_jax.configure import replace
from bdlm_jax.metrics import model_flops_per_step, peak_flops, peak_memory_bytes
from bdlm_jax.parallel.mesh import put_batch
from bdlm_jax.parallel.registry import SINGLE_DEVICE, strategy_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
TINY_CONFIG = os.path.join(ROOT, "configs", "tiny_csbp.py")
ONE_DEVICE = (f"parallel.strategy={SINGLE_DEVICE}", "parallel.seq=1", "train.batch_size=2")
TINY_STEPS = 3
# (a) on XLA:CPU: the losses of steps 1..TINY_STEPS, alike under xla and pallas.
CPU_LOSSES = (4.676260, 5.504078, 4.449335)
LOSS_RTOL = 1e-2  # a GPU's matmuls (TF32, other reduction orders) round differently
# (b): Llama-3.2-1B's dimensions; --dry-run: a small model at 128 tokens under xla (interpreted
# Pallas takes long to compile on CPU; (a) runs it).
ONE_B = ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                    head_dim=64, d_ff=8192, rope_theta=500000.0)
SMALL = ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, d_ff=128)
TIMED_STEPS = 3
# (c): scale_probe's arguments, and the committed tables its figures sit beside.
PROBE = ("--models", "llama3-8b", "--lens", "262144", "--devices", "16", "--timeout", "420")
DRY_PROBE = ("--models", "tiny", "--lens", "64", "--devices", "4", "--block-size", "16")
# block parallelism's ring and the context-parallel ring it is measured against
STRATEGIES = (*strategy_names(travels="clean", transport="ring", baseline=False),
              *strategy_names(baseline=True, transport="ring")[:1])
COMPILED_ELSEWHERE = {"XLA:TPU": "scale_probe_tpu.csv", "XLA:CPU": "scale_probe.csv"}


def train_losses(impl: str, steps: int) -> list[float]:
  """(a): the tiny config on one device, `steps` steps on batches drawn from a fixed seed."""
  cfg = load_config(TINY_CONFIG, [*ONE_DEVICE, f"model.attention_impl={impl}"])
  mesh = make_mesh(cfg)
  state = init_state(cfg, jax.random.key(cfg.seed), mesh)
  step = make_train_step(cfg, mesh)
  rng = np.random.default_rng(0)
  s, n = cfg.train.batch_size, cfg.data.seq_len
  losses = []
  for i in range(steps):
    tokens = rng.integers(0, cfg.objective.mask_token_id, (s, n), dtype=np.int32)
    batch = put_batch(make_batch(cfg, tokens), mesh, s, slice(0, s))
    state, metrics = step(state, batch, jax.random.fold_in(jax.random.key(1), i))
    losses.append(float(metrics["loss"]))
  return losses


def check_tiny(steps: int) -> dict:
  losses = {impl: train_losses(impl, steps) for impl in ("xla", "pallas")}
  worst = max(abs(a / b - 1) for run in losses.values() for a, b in zip(run, CPU_LOSSES))
  return dict(losses=losses, cpu_losses=CPU_LOSSES[:steps], worst_relative_error=worst,
              ok=worst <= LOSS_RTOL)


def one_step(model: ModelConfig, tokens: int, impl: str) -> dict:
  """(b): one sequence of `tokens` tokens on one device, bf16, attention `impl`: compiled
  once, run 1 + TIMED_STEPS times."""
  model = dataclasses.replace(model, compute_dtype="bfloat16", remat="full",
                              attention_impl=impl)
  cfg = replace(load_config(TINY_CONFIG, ONE_DEVICE), model=model, data=dict(seq_len=tokens),
                objective=dict(block_size=64, mask_token_id=model.vocab_size - 1),
                train=dict(batch_size=1))
  mesh = make_mesh(cfg)
  state = init_state(cfg, jax.random.key(0), mesh)
  ids = np.random.default_rng(0).integers(0, model.vocab_size - 1, (1, tokens), dtype=np.int32)
  batch = put_batch(make_batch(cfg, ids), mesh, 1, slice(0, 1))
  key = jax.random.key(1)
  start = time.perf_counter()
  compiled = make_train_step(cfg, mesh).lower(state, batch, key).compile()
  compile_s = time.perf_counter() - start
  memory = compiled_memory(compiled, jax.default_backend())
  state, metrics = compiled(state, batch, key)  # warm-up
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(TIMED_STEPS):
    state, metrics = compiled(state, batch, key)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / TIMED_STEPS
  peak = peak_flops(cfg)
  bound = (memory["argument_bytes"] + memory["temp_bytes"] + memory["output_bytes"]
           - memory["alias_bytes"])
  return dict(device=jax.devices()[0].device_kind, tokens=tokens, impl=impl, compile_s=compile_s,
              step_s=step_s, tokens_per_s=tokens / step_s,
              mfu=model_flops_per_step(cfg) / step_s / peak if peak else None,
              loss=float(metrics["loss"]), peak_bytes_in_use=peak_memory_bytes(),
              compiled_peak_bytes=memory["compiler_peak_bytes"] or bound, bound_bytes=bound)


def start_probe(dry_run: bool, out_dir: str) -> tuple[subprocess.Popen, str]:
  """(c): scale_probe in the background, its two compiles at once; (process, its CSV)."""
  target = "cpu" if dry_run else "gpu"
  command = [sys.executable, os.path.join(ROOT, "experiments", "scale_probe.py"),
             *(DRY_PROBE if dry_run else PROBE), "--target", target,
             "--strategies", *STRATEGIES, "--depth-check", "0", "--jobs", "2",
             "--out", out_dir]
  name = "scale_probe.csv" if dry_run else "scale_probe_gpu.csv"
  return (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
          os.path.join(out_dir, name))


def _rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return list(csv.DictReader(f))


def finish_probe(probe: subprocess.Popen, path: str) -> dict:
  """(c)'s rows, each beside the other compilers' peak for the same setting."""
  _, err = probe.communicate()
  rows = _rows(path)
  if probe.returncode or not rows:
    return dict(ok=False, error=(err.strip().splitlines() or ["no rows"])[-1])
  same = ("model", "seq_len", "strategy", "devices", "layers", "block_size", "remat")
  out = []
  for r in rows:
    row = dict(strategy=r["strategy"], error=r["error"],
               peak_gb=None if r["error"] else float(r["peak_bytes"]) / GB,
               bound_gb=None if r["error"] else float(r["bound_bytes"]) / GB)
    for compiler, csv_name in COMPILED_ELSEWHERE.items():
      match = next((o for o in _rows(os.path.join(RESULTS_DIR, csv_name))
                    if all(o.get(k) == r[k] for k in same) and not o.get("error")), None)
      row[f"{compiler} peak_gb"] = float(match["peak_bytes"]) / GB if match else None
    out.append(row)
  return dict(ok=not any(r["error"] for r in out), rows=out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dry-run", action="store_true",
                      help="on CPU, tiny shapes: the plumbing only (tests)")
  parser.add_argument("--out", default=RESULTS_DIR)
  args = parser.parse_args(argv)
  if not args.dry_run and jax.default_backend() != "gpu":
    raise SystemExit("gpu_check needs a GPU (jax sees none); --dry-run runs its plumbing here")
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as probe_dir:
    probe, probe_csv = start_probe(args.dry_run, probe_dir)
    results = dict(jax=jax.__version__, backend=jax.default_backend(), dry_run=args.dry_run,
                   tiny=check_tiny(TINY_STEPS))
    try:
      results["one_device_step"] = one_step(SMALL, 128, "xla") if args.dry_run else \
          one_step(ONE_B, 32768, "pallas")
    except Exception as e:  # noqa: BLE001 (an OOM or a kernel that fails is the finding)
      results["one_device_step"] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    results["mock_16_devices"] = finish_probe(probe, probe_csv)
  results["wall_s"] = time.perf_counter() - start
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps(results, indent=2))
  failed = [k for k in ("tiny", "mock_16_devices") if not results[k]["ok"]]
  failed += ["one_device_step"] if "error" in results["one_device_step"] else []
  print(f"{path}: " + (f"FAILED {', '.join(failed)}" if failed else "every check passed"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
