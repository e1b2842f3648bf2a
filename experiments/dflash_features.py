"""Precomputed target features for DFlash drafter training (`drafter.features`), for targets
too large to co-host with the drafter: the first N packed sequences of the config's training
pipeline and the frozen target's hidden states at its chosen layers.

  python experiments/dflash_features.py --config configs/dflash_tiny.py --out runs/tiny_feats \
      --sequences 4096 [--dtype float16]
  python run.py --config configs/dflash_tiny.py --set drafter.features=runs/tiny_feats \
      --set train.eval_every=0

The target (`drafter.target`, or random weights with --random-target, for tests) runs
causally over each sequence's documents exactly as the training step runs it, on the config's
mesh (`parallel.*`: its sequences split by `parallel.strategy` over `parallel.seq`, its
weights over `parallel.fsdp`), so a target that does not fit one device makes features for
sequences no device holds whole; `--set parallel.strategy=none parallel.seq=1 ...` runs it on
one. The folder's layout is bdlm_jax/data/features.py's; arrays are written batch by batch
into memory-mapped .npy files, so N may exceed host memory.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bdlm_jax import init_params, load_config, make_batch, make_mesh
from bdlm_jax.objectives import reserved_mask_id
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.config import Config
from bdlm_jax.configure import replace
from bdlm_jax.models.drafter import target_depth, target_layer_ids
from bdlm_jax.data import make_dataset
from bdlm_jax.data.features import META
from bdlm_jax.models.drafter import FROZEN
from bdlm_jax.params import merge_transformer
from bdlm_jax.parallel.mesh import to_host
from bdlm_jax.parallel.rows import row_runner
from bdlm_jax.parallel.strategies import make_attend, plan_for
from bdlm_jax.parallel.zero3 import gathered_weights

DTYPES = ("float32", "float16")


def one_device(cfg: Config) -> Config:
  """`cfg` with the target co-hosted on one device."""
  return replace(cfg, parallel=dict(strategy="none", seq=1, data=1, fsdp=1),
                 drafter=dict(features=""))


def writer_config(cfg: Config, mesh=None) -> Config:
  """`cfg` as the writer runs its target: co-hosted, on `mesh` (None: one device)."""
  return one_device(cfg) if mesh is None else replace(cfg, drafter=dict(features=""))


def random_target(cfg: Config, mesh=None) -> dict:
  """Random target weights (seeded by `cfg.seed`), as a co-hosted run would initialise them
  (on `mesh`, else one device)."""
  return init_params(writer_config(cfg, mesh), jax.random.key(cfg.seed), mesh)[FROZEN]


def target_features(cfg: Config, target_params, mesh=None):
  """`features(raw batch) -> [S, L, K, D]`: the target's outputs at `target_layer_ids(cfg)`
  for the sequences of a pipeline batch, computed as the training step computes them: over
  the context rows of `cfg`'s layout on `mesh` (None: one device), layers in
  `model.compute_dtype`, then put back in position order."""
  cfg = writer_config(cfg, mesh)
  plan = plan_for(cfg)
  context = functools.partial(plan.slot_rows, slot="clean")
  layer_weights = gathered_weights(mesh, jnp.dtype(cfg.model.compute_dtype))
  attend = make_attend(cfg, mesh, rows="clean", plan=plan)

  @jax.jit
  def run(params, batch):
    target = merge_transformer(cfg.model, params)
    feats, _ = target.features(context(batch.tokens), context(batch.pos),
                               jax.tree.map(context, batch.meta), attend,
                               target_layer_ids(cfg), target_depth(cfg), layer_weights,
                               row_runner(mesh))
    return feats[:, plan.context_rows]  # each position's row (its first copy under bp)

  def features(raw: dict) -> np.ndarray:
    batch = make_batch(cfg, raw["tokens"], raw["segment_ids"], raw.get("protected"))
    return to_host(run(target_params, batch))

  return features


def open_arrays(cfg: Config, out: str, sequences: int, dtype: str) -> dict:
  """The folder's .npy files, created at full size and memory-mapped for writing."""
  os.makedirs(out, exist_ok=True)
  n, l = sequences, cfg.data.seq_len
  shapes = dict(tokens=((n, l), np.int32), segment_ids=((n, l), np.int32),
                protected=((n, l), np.bool_),
                features=((n, l, len(target_layer_ids(cfg)), cfg.model.d_model), dtype))
  return {name: np.lib.format.open_memmap(os.path.join(out, f"{name}.npy"), mode="w+",
                                          dtype=dtype_, shape=shape)
          for name, (shape, dtype_) in shapes.items()}


def write_batch(arrays: dict, start: int, raw: dict, features) -> int:
  """Writes a pipeline batch (and its `features(raw)`) at records start..; only as many as
  the arrays still hold. Returns the next free record."""
  stop = min(start + len(raw["tokens"]), len(arrays["tokens"]))
  n = stop - start
  tokens = np.asarray(raw["tokens"])
  protected = raw.get("protected")
  arrays["tokens"][start:stop] = tokens[:n]
  arrays["segment_ids"][start:stop] = np.asarray(raw["segment_ids"])[:n]
  arrays["protected"][start:stop] = (np.zeros(tokens.shape, bool) if protected is None
                                     else np.asarray(protected))[:n]
  arrays["features"][start:stop] = features(raw)[:n]
  return stop


def write_features(cfg: Config, target_params, batches, out: str, sequences: int,
                   dtype: str = "float32", mesh=None) -> None:
  """The folder `out` for the first `sequences` sequences of the iterable `batches` (the
  pipeline's dicts), with the target `target_params` (placed on `mesh`; None: one device)."""
  features = target_features(cfg, target_params, mesh)
  arrays = open_arrays(cfg, out, sequences, dtype)
  start = 0
  for raw in batches:
    start = write_batch(arrays, start, raw, features)
    if start == sequences:
      break
  else:
    raise ValueError(f"the batches gave {start} sequences, fewer than {sequences}")
  for array in arrays.values():
    array.flush()
  meta = dict(seq_len=cfg.data.seq_len, target_layers=list(target_layer_ids(cfg)),
              d_model=cfg.model.d_model, dtype=dtype, target=cfg.drafter.target)
  with open(os.path.join(out, META), "w") as f:
    json.dump(meta, f, indent=1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True)
  parser.add_argument("--out", required=True, help="the features folder to write")
  parser.add_argument("--sequences", type=int, required=True, help="packed sequences N")
  parser.add_argument("--dtype", choices=DTYPES, default="float32")
  parser.add_argument("--random-target", action="store_true",
                      help="random target weights instead of drafter.target (tests)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  args = parser.parse_args(argv)
  cfg = load_config(args.config, args.set)
  mesh = make_mesh(cfg)
  cfg = writer_config(cfg, mesh)
  if args.random_target:
    cfg = replace(cfg, drafter=dict(target=""))
    target = random_target(cfg, mesh)
  else:
    target = load_target(cfg, mesh)
  data = make_dataset(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed,
                      vocab_size=cfg.model.vocab_size, block_size=cfg.objective.block_size,
                      mask_token_id=reserved_mask_id(cfg), split="train")
  write_features(cfg, target, data, args.out, args.sequences, args.dtype, mesh)
  print(f"wrote {args.sequences} sequences of features to {args.out}")


if __name__ == "__main__":
  main()
