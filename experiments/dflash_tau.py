"""Acceptance length tau of a DFlash drafter on held-out text (docs/dflash.md), trained
vs untrained, for the same frozen target.

  python experiments/dflash_tau.py --config configs/dflash_tiny.py [--workdir runs/dflash_tiny]
  # a drafter trained on precomputed features: the same --set as its run
  python experiments/dflash_tau.py --config configs/dflash_tiny.py --workdir W \
      --set drafter.features=F --set train.eval_every=0

For each held-out sequence, the anchors training would draw; at anchor a the drafter proposes
slots 1..B-1 of its block `[x_a, MASK ...]` in one forward (greedy: the head's argmax,
and with DFlash2's candidate selector also its left-to-right path), and the target decodes
B-1 tokens greedily from the document's prefix x_{<=a}. tau = 1 + the leading proposals equal
to the target's tokens (what speculative decoding with greedy verification accepts, plus the
target's own token), averaged over anchors; its ceiling is B. The untrained drafter is the
run's initialisation (same seed), next to the same target, which is always co-hosted here
(also for a drafter trained on precomputed features).

End to end (`bdlm_jax.speculative`): from prompts of `--prompt-tokens` tokens (held-out
documents' starts), `--new-tokens` tokens decoded speculatively, each block drafted from the
target's features and verified in one target forward; tau there is the tokens a verification
yields, and tokens per target forward counts the prompt's first forward too. The output is
checked against the target's own greedy decoding.
"""

import argparse

import jax
import numpy as np

from bdlm_jax import ar_logits, init_params, load_config, make_mesh
from bdlm_jax.objectives import reserved_mask_id
from bdlm_jax.checkpoint import restore_state
from bdlm_jax.checkpoint.target import load_target
from bdlm_jax.configure import replace
from bdlm_jax.data import make_dataset
from bdlm_jax.drafting import draft_proposals
from bdlm_jax.loop import default_workdir
from bdlm_jax.models.drafter import FROZEN, TRAINED
from bdlm_jax.parallel.mesh import to_host
from bdlm_jax.speculative import Speculator


def target_continuations(target, cfg, tokens_SL, seg_SL, anchors, steps: int) -> np.ndarray:
  """int [n, steps]: the target's greedy tokens after each (sequence, anchor a) of
  `anchors`, from its document's prefix x_{<=a} (placed at position 0: RoPE is relative)."""
  prefixes = []
  for s, a in anchors:
    doc = np.flatnonzero(seg_SL[s, :a + 1] == seg_SL[s, a])
    prefixes.append(tokens_SL[s, doc[0]:a + 1])
  lengths = np.asarray([len(p) for p in prefixes])
  width = -(-(lengths.max() + steps) // 16) * 16  # a few shapes, few compiles
  buf = np.zeros((len(prefixes), width), np.int32)
  for i, p in enumerate(prefixes):
    buf[i, :len(p)] = p
  out = np.zeros((len(prefixes), steps), np.int64)
  rows = np.arange(len(prefixes))
  for k in range(steps):
    logits = np.asarray(ar_logits(target, cfg, buf))
    out[:, k] = logits[rows, lengths + k - 1].argmax(-1)
    buf[rows, lengths + k] = out[:, k]
  return out


def acceptance(params, cfg, batches, selector: bool = False) -> tuple[float, int]:
  """(mean tau, anchors scored) of `params` (a drafter and its target) over `batches`; the
  drafter proposes through its candidate selector with `selector` (DFlash2)."""
  taus = []
  b = cfg.objective.block_size
  for raw in batches:
    tokens, seg = raw["tokens"], raw["segment_ids"]
    proposed, rows = draft_proposals(params, cfg, tokens, seg, raw.get("protected"), selector)
    a_count = cfg.objective.max_anchors
    block = np.asarray(rows.block)[:, :a_count * b].reshape(len(tokens), a_count, b)[..., 0]
    valid = np.asarray(rows.seg)[:, :a_count * b].reshape(len(tokens), a_count, b)[..., 0] > 0
    anchors = [(s, int(block[s, j])) for s, j in zip(*np.nonzero(valid))]
    proposed = np.asarray(proposed)[valid]  # slots 1..B-1
    wanted = target_continuations(params[FROZEN], cfg, tokens, seg, anchors, b - 1)
    leading = np.cumprod(proposed == wanted, axis=1).sum(axis=1)
    taus.extend(1 + leading)
  return float(np.mean(taus)), len(taus)


def prompts_of(batches, length: int) -> list[list[int]]:
  """The first `length` tokens of each held-out sequence whose first document is longer."""
  out = []
  for raw in batches:
    for tokens, seg in zip(raw["tokens"], raw["segment_ids"]):
      if seg[0] > 0 and (seg[:length + 1] == seg[0]).all():
        out.append([int(t) for t in tokens[:length]])
  return out


def end_to_end(params, cfg, prompts, new_tokens: int, selector: bool) -> tuple[float, float, bool]:
  """(tau, tokens per target forward, whether every output is the target's greedy one) of
  speculative decoding from `prompts`."""
  spec = Speculator(params, cfg, selector)
  runs = [(spec.decode(p, new_tokens), spec.greedy(p, new_tokens)) for p in prompts]
  accepted = [k for out, _ in runs for k in out.accepted]
  forwards = sum(out.target_forwards for out, _ in runs)
  return (1 + float(np.mean(accepted)), len(prompts) * new_tokens / forwards,
          all(out.tokens == greedy.tokens for out, greedy in runs))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", default=None, help="the drafter's run (default runs/<config>)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--batches", type=int, default=2, help="held-out batches")
  parser.add_argument("--prompts", type=int, default=8, help="end to end: prompts decoded")
  parser.add_argument("--prompt-tokens", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=32)
  args = parser.parse_args(argv)
  cfg = load_config(args.config, args.set + ["parallel.strategy=none", "parallel.seq=1",
                                             "parallel.data=1", "parallel.fsdp=1"])
  workdir = args.workdir or default_workdir(args.config)
  mesh = make_mesh(cfg)
  step, state = restore_state(cfg, workdir, mesh)  # with the config it trained with
  # Evaluated with the whole target co-hosted, also for a drafter trained on features.
  cfg = replace(cfg, drafter=dict(features=""))
  target = jax.tree.map(to_host, load_target(cfg, mesh))
  drafters = {"untrained (init)": init_params(cfg, jax.random.split(
                  jax.random.key(cfg.seed))[0])[TRAINED],
              f"trained (step {step})": state.params[TRAINED]}
  data = make_dataset(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed,
                      vocab_size=cfg.model.vocab_size, block_size=cfg.objective.block_size,
                      mask_token_id=reserved_mask_id(cfg), split="eval")
  batches = [next(data) for _ in range(args.batches)]
  print(f"target {cfg.drafter.target}; drafter {workdir} step {step}; B = "
        f"{cfg.objective.block_size} (tau <= {cfg.objective.block_size})")
  print("| drafter | proposals | tau | anchors |\n|---|---|---|---|")
  modes = (False, True) if cfg.objective.selector_rank else (False,)
  for name, drafter in drafters.items():
    for selector in modes:
      tau, n = acceptance({TRAINED: jax.tree.map(to_host, drafter), FROZEN: target}, cfg,
                          batches, selector)
      print(f"| {name} | {'selector' if selector else 'head argmax'} | {tau:.3f} | {n} |")
  prompts = prompts_of(batches, args.prompt_tokens)[:args.prompts]
  print(f"\nend to end: {len(prompts)} prompts of {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens each")
  print("| drafter | proposals | tau | tokens / target forward | = target's greedy |\n"
        "|---|---|---|---|---|")
  for name, drafter in drafters.items():
    for selector in modes:
      tau, per_forward, same = end_to_end(
          {TRAINED: jax.tree.map(to_host, drafter), FROZEN: target}, cfg, prompts,
          args.new_tokens, selector)
      print(f"| {name} | {'selector' if selector else 'head argmax'} | {tau:.3f} "
            f"| {per_forward:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
  main()
