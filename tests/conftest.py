"""Test-wide setup: 8 simulated CPU devices; fixtures for checks of file permissions that also
hold when the tests run as root.

No persistent compilation cache: on jax 0.10.2 an XLA:CPU executable loaded from it can run two
collectives of one device at once, and with 8 simulated devices on 2 cores that deadlocks
(`Termination timeout for collective permute ... only 1 of them arrived`, then an abort)."""

import contextlib
import os
import pathlib
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# The suite compiles hundreds of small programs and runs each a few times: without LLVM's
# optimisations and XLA:CPU's fusion emitters a compile takes a third of the time.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

NOBODY = 65534
# The longest files (minutes each) first: with `--dist loadfile` a file runs whole on one
# worker, taken in collection order, and these two, collected last, would end the run alone.
LONGEST_FIRST = ("test_readme.py", "test_sample.py")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: over ~5 s on 2 idle cores (a long compile, training, several processes "
      "or a shared fixture that runs many commands); `-m \"not slow\"` is the fast tier "
      "(docs/tests.md)")


def pytest_collection_modifyitems(items):
  rank = lambda item: next((i for i, name in enumerate(LONGEST_FIRST)
                            if item.path.name == name), len(LONGEST_FIRST))
  items.sort(key=rank)  # stable: each file keeps its own order


@pytest.fixture
def shared_tmp():
  """A temporary folder anyone may write in (pytest's tmp_path sits in a root-only one)."""
  with tempfile.TemporaryDirectory() as folder:
    os.chmod(folder, 0o777)
    yield pathlib.Path(folder)


@pytest.fixture
def permissions_enforced():
  """A context in which file permissions apply: root ignores them, so as root it acts as
  `nobody` (effective ids only, so that root comes back after). Make the files to check in it
  too, so that their own mode is what denies access."""
  @contextlib.contextmanager
  def as_nobody():
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
      yield
    finally:
      os.seteuid(0)
      os.setegid(0)
  return as_nobody if os.geteuid() == 0 else contextlib.nullcontext
