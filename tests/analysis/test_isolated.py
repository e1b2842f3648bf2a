"""A compile that dies in its own process is a row saying why, named by what ended it."""

import signal

from bdlm_jax.analysis import isolated


def test_a_killed_compile_names_its_signal_and_an_oom_kill_says_what_it_usually_is():
  # the libtpu warning a worker prints at start is not why it died
  stderr = "WARNING: could not determine TPU accelerator type\n"
  assert isolated.crash_reason(-signal.SIGKILL, stderr).startswith(
      "killed by SIGKILL (on Linux, usually the out-of-memory killer")
  assert isolated.crash_reason(-signal.SIGSEGV, stderr) == "killed by SIGSEGV"
  assert isolated.crash_reason(3, "Traceback ...\nValueError: bad\n") == \
      "crashed (exit 3): ValueError: bad"
  assert isolated.crash_reason(1, "") == "crashed (exit 1): no output"
