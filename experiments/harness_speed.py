"""Requests per second and the NELBO's Monte Carlo error of the lm-eval model `bdlm_jax`, on
the local arithmetic tasks (tests/harness_tasks):

  python experiments/harness_speed.py --workdir runs/quickstart [--n 200] [--draws 32]

Writes the tasks' data (make.py, seed 0), then times the harness's `loglikelihood` on every
(prompt, choice) request of arith_mc and its `generate_until` on arith_gen, each run twice
on one `BdlmLM` (the first run compiles; the second is the warm rate). For a BDLM it also
prints the standard error of each request's NELBO estimate at `--draws` draws (from the draws'
spread), and the multiple-choice accuracy under two seeds (other noise) to show what that
error does to a score.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--n", type=int, default=200)
  parser.add_argument("--draws", type=int, default=32)
  parser.add_argument("--batch_size", type=int, default=32)
  args = parser.parse_args()
  from lm_eval.api.instance import Instance
  from bdlm_jax.harness_lm import BdlmLM
  from bdlm_jax.likelihood import exact
  from tests.harness_tasks.make import write_tasks
  folder = tempfile.mkdtemp()
  write_tasks(folder, args.n, 56)
  read = lambda task: [json.loads(line) for line in open(os.path.join(folder, f"{task}.jsonl"))]
  mc, gen = read("arith_mc"), read("arith_gen")
  lm = BdlmLM(workdir=args.workdir, mc_samples=args.draws, batch_size=args.batch_size)
  requests = [Instance("loglikelihood", {}, (d["prompt"], c), i)
              for i, d in enumerate(mc) for c in d["choices"]]
  generations = [Instance("generate_until", {}, (d["prompt"], dict(until=[" "], max_gen_toks=4)),
                          i) for i, d in enumerate(gen)]

  def timed(fn, items):
    start = time.perf_counter()
    out = fn(items)
    return out, len(items) / (time.perf_counter() - start)

  for name, fn, items in (("loglikelihood", lm.loglikelihood, requests),
                          ("generate_until", lm.generate_until, generations)):
    _, cold = timed(fn, items)
    out, warm = timed(fn, items)
    print(f"{name}: {len(items)} requests, {cold:.1f} req/s with compiles, {warm:.1f} warm")
    if name == "loglikelihood":
      scores = np.asarray([s for s, _ in out]).reshape(len(mc), -1)
      labels = np.asarray([d["label"] for d in mc])
      print(f"  arith_mc accuracy {np.mean(scores.argmax(1) == labels):.3f} (seed 0)")
    else:
      print(f"  arith_gen exact match {np.mean([t == d['answer'] for t, d in zip(out, gen)]):.3f}")
  if exact(lm.cfg):
    return
  pairs = [(lm.tok_encode(d["prompt"]), lm.tok_encode(c)) for d in mc for c in d["choices"]]
  for seed in (0, 1):
    lm.seed = seed
    got = lm._scores(pairs)
    scores = got.logprob.reshape(len(mc), -1)
    accuracy = np.mean(scores.argmax(1) == np.asarray([d["label"] for d in mc]))
    print(f"seed {seed}: NELBO standard error per request at {args.draws} draws: mean "
          f"{np.mean(got.stderr):.3f} nats, median {np.median(got.stderr):.3f} "
          f"({np.median(got.stderr / np.abs(got.logprob)):.1%} of the estimate); "
          f"arith_mc accuracy {accuracy:.3f}")


if __name__ == "__main__":
  main()
