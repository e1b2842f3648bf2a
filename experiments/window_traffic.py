"""Per-layer attention traffic of global and local (sliding-window) layers, every strategy.

  python experiments/window_traffic.py          # P = 8, B = L/32, W = 1024, L 16K..64K
  python experiments/window_traffic.py --tiny   # P = 4, small L: seconds

One attention layer, forward + backward, compiled on simulated CPU devices from abstract
shapes (`analysis.probe`, the real `make_attend` path) for each strategy and L: collective
bytes per device read from the compiled HLO, float32 K/V (XLA:CPU would widen bf16 anyway),
GQA with 8 K/V heads of 128. A global layer moves what its transport moves (a ring or an
all-gather of the travelling K/V); a local layer of window W moves what the windowed exchange
(parallel/window.py) plans, wherever that is less. At fixed W and blocks per rank (B grows
with L here), csbp's local layer moves the same bytes at every L. Writes
window_traffic.{csv,md,png} under --out and refreshes the results pages (docs/results/).
"""

import argparse
import csv
import os

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from bdlm_jax.analysis.probe import attention_layer_costs, layer_config  # noqa: E402
from bdlm_jax.analysis.results import write_results_pages  # noqa: E402
from bdlm_jax.parallel.registry import get_strategy, plan_for, strategy_names  # noqa: E402
from bdlm_jax.parallel.strategies import exchange_for, window_transport  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _one_per_transport() -> tuple[str, ...]:
  """The first registered strategy of each (transport, what travels): another layout of the
  same pair moves the same bytes on a global layer (cp_ring_balanced moves cp_ring's)."""
  first = {}
  for name in strategy_names(splits_sequences=True, needs_drafter=False):
    record = get_strategy(name)
    first.setdefault((record.transport, record.travels), name)
  return tuple(first.values())


STRATEGIES = _one_per_transport()
FIELDS = ["strategy", "P", "L", "B", "W", "layer", "transport", "attn_bytes", "rows_sent",
          "rows_needed", "temp_bytes"]
MiB = 2**20
GRIDS = {  # (P, blocks per rank, W, heads (q, kv, dim), lengths)
    "full": (8, 4, 1024, (32, 8, 128), (16384, 32768, 65536)),
    "tiny": (4, 4, 8, (4, 2, 16), (256, 512)),
    "smoke": (4, 4, 8, (4, 2, 16), (256,)),  # tests
}


def measure(grid: str, strategies=STRATEGIES, progress=print) -> list[dict]:
  p, blocks_per_rank, window, (hq, hkv, d), lens = GRIDS[grid]
  rows = []
  for seq_len in lens:
    block = seq_len // (p * blocks_per_rank)
    for strategy in strategies:
      plan = plan_for(layer_config(strategy, seq_len, p, block, n_heads=hq, n_kv_heads=hkv,
                                   head_dim=d))
      for layer, w in (("global", None), ("local", window)):
        costs = attention_layer_costs(strategy, seq_len, p, block, n_heads=hq, n_kv_heads=hkv,
                                      head_dim=d, window=w)
        transport = window_transport(plan, w) if w else get_strategy(strategy).transport
        exchange = exchange_for(plan, w) if transport == "exchange" else None
        rows.append(dict(strategy=strategy, P=p, L=seq_len, B=block, W=window, layer=layer,
                         transport=transport, attn_bytes=costs["total_collective_bytes"],
                         rows_sent=exchange.rows_sent() if exchange else "",
                         rows_needed=exchange.rows_needed() if exchange else "",
                         temp_bytes=costs["temp_bytes"]))
        progress(" ".join(f"{k}={v}" for k, v in rows[-1].items()))
  return rows


def markdown(rows) -> str:
  lens = sorted({r["L"] for r in rows})
  strategies = [s for s in STRATEGIES if any(r["strategy"] == s for r in rows)]
  first = rows[0]
  out = ["## Local vs global layers: attention traffic per layer", "",
         f"`python experiments/window_traffic.py`: one attention layer, forward + backward, "
         f"compiled on {first['P']} simulated devices; collective MiB per device (float32 K/V), "
         f"window W = {first['W']}, B = L / (4 P) (4 blocks per rank). A local layer uses the "
         f"windowed exchange wherever it moves less than the global transport.", "",
         "| strategy | layer | " + " | ".join(f"L = {n}" for n in lens) + " |",
         "|---|---|" + "---|" * len(lens)]
  for strategy in strategies:
    for layer in ("global", "local"):
      cells = [next(r for r in rows if r["strategy"] == strategy and r["layer"] == layer
                    and r["L"] == n) for n in lens]
      out.append(f"| {strategy} | {layer} ({cells[-1]['transport']}) | "
                 + " | ".join(f"{c['attn_bytes'] / MiB:.2f}" for c in cells) + " |")
  rings = [s for s in strategies if get_strategy(s).transport == "ring"]
  local = {s: [r for r in rows if r["strategy"] == s and r["layer"] == "local"] for s in rings}
  csbp = [r["attn_bytes"] for s in rings if get_strategy(s).travels == "clean" for r in local[s]]
  same = "the same bytes" if len(set(csbp)) == 1 else "different bytes"
  out += ["", f"csbp's local layer moves {same} at every L ({csbp[0] / MiB:.2f} MiB); its "
          f"global ring grows with L. Rows a rank sends on a local layer (one `ppermute` per "
          f"ring distance, each padded to its largest sender) vs the most a rank's windows "
          f"need: " + "; ".join(f"{s} {r['rows_sent']} vs {r['rows_needed']} (L = {r['L']})"
                               for s in local for r in local[s][-1:]) + ".", ""]
  return "\n".join(out)


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  moving = {r["strategy"] for r in rows if get_strategy(r["strategy"]).transport != "local"}
  for i, strategy in enumerate(sorted(moving)):
    for layer, style in (("global", "-"), ("local", "--")):
      pts = [(r["L"], r["attn_bytes"] / MiB) for r in rows
             if r["strategy"] == strategy and r["layer"] == layer]
      ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{strategy} {layer}")
  ax.set(xscale="log", yscale="log", xlabel="L (tokens)", ylabel="MiB per device per layer",
         title="Attention traffic: global vs local layers")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--tiny", action="store_true", help="P = 4, small L (seconds)")
  ap.add_argument("--out", default=RESULTS_DIR)
  args = ap.parse_args(argv)
  write(measure("tiny" if args.tiny else "full"), args.out)


def write(rows, out_dir):
  """window_traffic.{csv,md,png} under `out_dir`, and its results pages refreshed."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "window_traffic.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, FIELDS)
    writer.writeheader()
    writer.writerows(rows)
  text = markdown(rows)
  with open(os.path.join(out_dir, "window_traffic.md"), "w") as f:
    f.write(text)
  plot(rows, os.path.join(out_dir, "window_traffic.png"))
  write_results_pages(out_dir)
  print(text)


if __name__ == "__main__":
  main()
