"""Writes the two local lm-eval tasks on held-out arithmetic (arith_gen.yaml, arith_mc.yaml
beside this file) into a folder, their data as JSONL under absolute paths (the harness reads
`data_files` relative to the working directory, not to the YAML):

  python tests/harness_tasks/make.py OUT [--n 200] [--seq_len 56] [--seed 0]

then `--include_path OUT --tasks arith_gen,arith_mc`. Prompts are the held-out ones of
`evaluate.arithmetic_prompts` (seed `--seed`), each with its answer within `--seq_len` tokens.
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = ("arith_gen", "arith_mc")
CHOICES = 4


def write_tasks(folder: str, n: int, seq_len: int, seed: int = 0) -> list[str]:
  """The task names, after writing their YAML and JSONL into `folder`."""
  from bdlm_jax.config import Config
  from bdlm_jax.configure import replace
  from bdlm_jax.evaluate import arithmetic_prompts
  folder = os.path.abspath(folder)
  os.makedirs(folder, exist_ok=True)
  cfg = replace(Config(), seed=seed, data=dict(seq_len=seq_len), objective=dict(name="ar"))
  pairs = arithmetic_prompts(cfg, n)
  answers = sorted({answer for _, answer in pairs})
  rng = np.random.default_rng(seed)
  records = dict(arith_gen=[], arith_mc=[])
  for prompt, answer in pairs:
    records["arith_gen"].append(dict(prompt=prompt, answer=answer))
    others = rng.choice([a for a in answers if a != answer], CHOICES - 1, replace=False).tolist()
    label = int(rng.integers(CHOICES))
    choices = others[:label] + [answer] + others[label:]
    records["arith_mc"].append(dict(prompt=prompt, choices=choices, label=label))
  for task in TASKS:
    with open(os.path.join(folder, f"{task}.jsonl"), "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in records[task])
    with open(os.path.join(HERE, f"{task}.yaml"), encoding="utf-8") as f:
      text = f.read().replace("DATA/", folder + "/")
    with open(os.path.join(folder, f"{task}.yaml"), "w", encoding="utf-8") as f:
      f.write(text)
  return list(TASKS)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("out")
  parser.add_argument("--n", type=int, default=200)
  parser.add_argument("--seq_len", type=int, default=56)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
  print(",".join(write_tasks(args.out, args.n, args.seq_len, args.seed)))
