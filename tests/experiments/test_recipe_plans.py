"""recipe_plans compiles a shipped config and a variant of it, each in a subprocess, and writes
a CSV and markdown that a later run's rows merge into."""

import csv
import json

import pytest

from experiments import recipe_plans


@pytest.mark.slow
def test_a_recipe_and_its_variant_compile_into_rows(tmp_path):
  # configs/dflash2_tiny.py: plan.target cpu, csbp_ring on its one device; the variant turns
  # context pruning off on two. One strategy: 2 compiles (~15 s).
  recipe_plans.main(["--config", "configs/dflash2_tiny.py", "--strategies", "csbp_ring",
                     "--variant", "wide: drafter.kept_context_rows=0 parallel.seq=2",
                     "--out", str(tmp_path)])
  with open(tmp_path / "recipe_plans.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  assert sorted(rows) == ["recipe", "wide"]
  for r in rows.values():
    assert not r["error"] and r["fits"] == "yes" and r["target"] == "cpu"
    assert min(float(r[k]) for k in ("argument_bytes", "peak_bytes", "compile_s")) > 0
    assert float(r["bound_bytes"]) >= float(r["peak_bytes"])
    # the device's own figures (XLA:CPU: the bound plus constants), which the fit is judged by
    assert float(r["device_allocated_bytes"]) >= float(r["device_live_bytes"]) > 0
    assert float(r["device_allocated_bytes"]) >= float(r["bound_bytes"])
  assert (rows["recipe"]["devices"], rows["wide"]["devices"]) == ("1", "2")
  assert json.loads(rows["wide"]["overrides"]) == ["drafter.kept_context_rows=0",
                                                   "parallel.seq=2"]
  text = (tmp_path / "recipe_plans.md").read_text()
  assert "### configs/dflash2_tiny.py" in text and "| wide | drafter.kept_context_rows=0" in text
  assert text.count("Produced by `python experiments/recipe_plans.py --config") == 1
  assert (tmp_path / "recipes.md").exists()  # the results page, beside a scratch folder


def test_merge_replaces_the_rows_it_measures_and_keeps_the_rest():
  old = [dict(config="a", variant="recipe", strategy="x", peak_bytes=1),
         dict(config="a", variant="recipe", strategy="y", peak_bytes=2)]
  new = [dict(config="a", variant="recipe", strategy="y", peak_bytes=3)]
  assert recipe_plans.merge(old, new) == [old[0], new[0]]


def test_a_variant_needs_a_name_other_than_the_recipes():
  assert recipe_plans.parse_variant("ours: a=1 b=2") == ("ours", ["a=1", "b=2"])
  for bad in ("a=1", "recipe: a=1", ": a=1"):
    with pytest.raises(SystemExit, match="expected 'name: KEY=VALUE"):
      recipe_plans.parse_variant(bad)


def test_each_row_gets_the_programs_attention_and_gdn_operand_bytes_without_a_compile():
  """configs/qwen3_5_tiny.py on 4 ranks: 3 of its 4 layers Gated DeltaNet, whose streams the
  row's ratio puts over attention's; a model without them gets no ratio."""
  row = dict(config="configs/qwen3_5_tiny.py", variant="seq4", strategy="csbp_ring",
             overrides=json.dumps(["parallel.seq=4"]), error="")
  filled = recipe_plans.with_operands(row)
  attention, gdn = (filled[k] for k in recipe_plans.OPERANDS)
  assert attention > 0 and gdn > 0
  assert recipe_plans._ratio(filled) == f"{gdn / attention:.3f}"
  assert recipe_plans.with_operands(filled) is filled  # filled once
  plain = recipe_plans.with_operands(dict(row, config="configs/tiny_csbp.py", overrides="[]"))
  assert plain["expected_recurrence_operand_bytes"] == 0 and recipe_plans._ratio(plain) == ""
