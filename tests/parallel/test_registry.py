"""A strategy is one record in the registry: a toy one, registered here and nowhere in the
package, gets the single-device contract, the traffic report and `mode=plan` for free."""

import numpy as np
import pytest

from bdlm_jax import make_mesh
from bdlm_jax.analysis import plan_mode
from bdlm_jax.analysis import step_report as sr
from bdlm_jax.configure import override
from bdlm_jax.errors import ConfigError
from bdlm_jax.parallel import registry
from bdlm_jax.parallel.layout import LayoutPlan
from tests.analysis.test_step_report import config as report_config
from tests.parallel.test_strategies import BLOCKS, _assert_matches_reference, _cfg

TOY = "toy_contiguous_ring"


def contiguous_plan(name, L, B, P, noisy_stream=True, draft_blocks=0) -> LayoutPlan:
  """Rank r holds the r-th contiguous chunk of the noisy half and of the clean half (no
  zigzag balance); every K/V row travels."""
  if draft_blocks or not noisy_stream:
    raise ConfigError(f"{name} lays out the [x_t ; x_0] stream only")
  noisy = np.arange(L).reshape(P, -1)
  return LayoutPlan(name, L, B, np.concatenate([noisy, L + noisy], 1).astype(np.int32),
                    L // P, "all")


@pytest.fixture
def toy():
  registry.register(registry.Strategy(TOY, contiguous_plan, "ring", "all", baseline=False,
                                      summary="test only: contiguous chunks, all K/V ring"))
  yield TOY
  registry.unregister(TOY)


def test_a_registered_strategy_is_a_valid_config_value_and_then_not(toy):
  assert override(_cfg(), [f"parallel.strategy={toy}", "parallel.seq=8"])
  registry.unregister(toy)
  with pytest.raises(ConfigError, match=f"parallel.strategy='{toy}' is not one of"):
    override(_cfg(), [f"parallel.strategy={toy}"])
  registry.register(registry.Strategy(toy, contiguous_plan, "ring", "all", False, ""))


def test_a_toy_strategy_gives_the_single_device_loss_and_grads(toy):
  cfg = _cfg(toy, BLOCKS["N>2P"], seq=8)
  _assert_matches_reference(cfg, make_mesh(cfg))


@pytest.mark.slow
def test_a_toy_strategys_compiled_attention_bytes_are_its_plans(toy):
  report = sr.step_report(report_config(toy, seq=4))
  assert report.attention_bytes > 0 and 0.99 <= report.attention_check <= 1.01


def test_mode_plan_lists_a_toy_strategy_and_plans_only_the_named_ones(toy):
  cfg = report_config("csbp_ring", seq=2)
  assert toy in plan_mode.planned_strategies(cfg)
  named = override(cfg, [f"plan.strategies={toy},cp_ring"])
  assert plan_mode.planned_strategies(named) == (toy, "cp_ring")
  with pytest.raises(ConfigError, match=r"plan.strategies='cp_ring,ring': ring cannot split a "
                                        r"bd3lm sequence here; choose among .*csbp_ring"):
    plan_mode.planned_strategies(override(cfg, ["plan.strategies=cp_ring,ring"]))


@pytest.mark.slow
def test_mode_plan_compiles_a_toy_strategy(toy):
  cfg = override(report_config("csbp_ring", seq=2), [f"plan.strategies={toy},csbp_ring"])
  text = plan_mode.plan_report(cfg)
  row = next(line for line in text.splitlines() if line.startswith(f"| {toy} |"))
  assert "not run" not in row and "chosen:" in text


def test_a_record_whose_plan_moves_other_rows_than_it_says_is_refused(toy):
  registry.unregister(toy)
  registry.register(registry.Strategy(toy, contiguous_plan, "ring", "clean", False, ""))
  with pytest.raises(ValueError, match="registered as moving 'clean' K/V, but its plan moves "
                                       "'all'"):
    registry.make_plan(toy, 64, 4, 2)
