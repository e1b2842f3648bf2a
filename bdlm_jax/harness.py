"""lm-evaluation-harness with the `bdlm_jax` model: lm-eval's own command line, run as

  python -m bdlm_jax.harness --model bdlm_jax --model_args workdir=RUN[,step=N,mc_samples=32,
      steps_per_block=2,...] --tasks TASKS [--include_path FOLDER] [--batch_size 16]

lm-eval 0.4.13 finds models registered in its own process only, so this module imports the
model (bdlm_jax.harness_lm) and hands the arguments to lm-eval's CLI. docs/evaluate.md.
"""

import sys

from bdlm_jax.errors import ConfigError
from bdlm_jax.harness_lm import BdlmLM  # noqa: F401  registers --model bdlm_jax


def main() -> int:
  from lm_eval.__main__ import cli_evaluate
  try:
    cli_evaluate()
  except ConfigError as e:
    print(f"bdlm_jax harness: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
