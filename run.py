"""Command line: python run.py --config configs/quickstart.py [--set a.b=c ...]
[--resume | --resume-if-present] [--allow-changes]."""

import argparse
import json
import os
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True, help="Python file exposing get_config()")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set parallel.strategy=csbp_ring")
  parser.add_argument("--workdir", default=None,
                      help="checkpoints and metrics (default runs/<config>)")
  resume_flags = parser.add_mutually_exclusive_group()
  resume_flags.add_argument("--resume", action="store_true",
                            help="continue from the latest checkpoint of --workdir, which must "
                                 "hold one")
  resume_flags.add_argument("--resume-if-present", action="store_true",
                            help="continue if --workdir holds a checkpoint, else start a new run "
                                 "there (for preemptible jobs that rerun one command)")
  parser.add_argument("--allow-changes", action="store_true",
                      help="resume with settings that change the run (train.steps, batch, lr, "
                           "data, seed...); the changes are logged")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)

  from bdlm_jax.configure import load_config
  from bdlm_jax.errors import ConfigError
  try:
    cfg = load_config(args.config, args.set)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  if cfg.mode == "prepare":  # CPU work: no devices are set up
    return prepare(cfg, progress=not args.no_progress)
  needed = cfg.parallel.data * cfg.parallel.fsdp * cfg.parallel.seq
  if needed > 1 and not cfg.parallel.distributed:
    # Simulated devices on a CPU-only host; ignored where real accelerators are present.
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(needed))
  import jax
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    try:
      jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
    except RuntimeError:
      pass  # JAX already started (main() called in-process); make_mesh reports a shortfall
  from bdlm_jax.checkpoint import CheckpointError
  from bdlm_jax.data import DataError
  from bdlm_jax.loop import BadStepsError, default_workdir, say_interpreted, train
  from bdlm_jax.objectives import get_objective
  from bdlm_jax.parallel.experts import check_dispatch_runs_here
  workdir = args.workdir or default_workdir(args.config)
  try:
    if cfg.mode == "export":
      from bdlm_jax.checkpoint.hf_export import export_checkpoint
      step, out_dir = export_checkpoint(cfg, workdir)
      print(f"exported step {step} of {workdir} to {out_dir} (Hugging Face format)")
      return 0
    if cfg.mode in ("eval", "sample"):  # train checks in loop.train, plan per strategy
      check_dispatch_runs_here(cfg)
      say_interpreted(cfg)
    if cfg.mode == "plan":
      from bdlm_jax.analysis.plan_mode import plan_report
      print(plan_report(cfg, progress=lambda line: print(line, file=sys.stderr)))
      return 0
    if cfg.mode == "eval":
      from bdlm_jax.evaluate import describe, evaluate_checkpoint
      step, metrics = evaluate_checkpoint(cfg, workdir)
      if jax.process_index() == 0:
        print(f"step {step} of {workdir}: {describe(metrics, cfg.objective.name)}")
        print(json.dumps(dict(step=step, **metrics)))
      return 0
    if cfg.mode == "sample":
      if get_objective(cfg.objective.name).DRAFTER:  # drafted, verified by its target
        from bdlm_jax.speculative import sample_checkpoint
      else:
        from bdlm_jax.sample import sample_checkpoint
      step, prompt, completion, stats = sample_checkpoint(cfg, workdir)
      print(f"step {step} of {workdir}; prompt {prompt!r}; {stats.describe()}; completion:",
            file=sys.stderr)
      print(completion)
      return 0
    resume = "if_present" if args.resume_if_present else args.resume
    history = train(cfg, workdir, resume=resume, progress=not args.no_progress,
                    allow_changes=args.allow_changes)
    shown = None
    if history and "eval_loss" in history[-1]:
      from bdlm_jax.evaluate import show_sample
      shown = show_sample(cfg, workdir)  # on every process: restoring the params is collective
  except (ConfigError, DataError, CheckpointError, BadStepsError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:  # loop.Interrupted says what the workdir holds
    print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
    return 128 + getattr(e, "signum", 2)
  if jax.process_index() == 0:
    if not history:
      print(f"nothing to train: {workdir} is already at train.steps={cfg.train.steps} or past it")
      return 0
    first, last = history[0], history[-1]
    print(f"trained {last['step']} steps: loss {first['loss']:.4f} (step {first['step']}) -> "
          f"{last['loss']:.4f}; {last['tokens_per_s']:.0f} tokens/s; workdir {workdir}")
    if shown is not None:
      from bdlm_jax.evaluate import describe
      if cfg.pretrain.objective:
        first_stage(cfg, workdir)
      print(describe(last, cfg.objective.name))
      print(shown)
  return 0


def first_stage(cfg, workdir: str) -> None:
  """The first stage of a two-stage run (`pretrain.*`): the step its export holds and that
  step's own held-out figures."""
  from bdlm_jax.evaluate import describe
  from bdlm_jax.loop import exported_step, pretrain_dir
  from bdlm_jax.metrics import evaluated_at
  folder = pretrain_dir(workdir)
  step = exported_step(os.path.join(folder, "hf"), verified=False)  # for its figures: no rehash
  row = evaluated_at(folder, step) if step is not None else None
  figures = (describe(row, cfg.pretrain.objective) if row is not None else
             "no held-out figures recorded at that step" if step is not None else
             "no finished export (the second stage resumed from its own checkpoint)")
  steps = f"{step} steps" if step is not None else f"{cfg.pretrain.steps} steps planned"
  print(f"stage 1, {cfg.pretrain.objective} ({steps}, {folder}): {figures}")
  print(f"stage 2, {cfg.objective.name} from it ({cfg.train.steps} steps, {workdir}):")


def prepare(cfg, progress: bool) -> int:
  """mode=prepare: tokenize the corpus once (bdlm_jax/data/prepare.py)."""
  from bdlm_jax.data import DataError
  from bdlm_jax.data.prepare import prepare as prepare_corpus
  from bdlm_jax.errors import ConfigError
  try:
    folders = prepare_corpus(cfg, progress=progress)
  except (ConfigError, DataError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted; the shards written are kept: rerun the same command to continue",
          file=sys.stderr)
    return 130
  for folder, meta in folders.items():
    print(f"{folder}: {meta['documents']:,} documents, {meta['tokens']:,} tokens of "
          f"{meta['path']} ({meta['tokenizer']} tokenizer)")
  train, *held_out = folders
  print(f"read it with --set data.source=tokens --set data.path={train}" +
        "".join(f" --set data.eval_path={f}" for f in held_out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
