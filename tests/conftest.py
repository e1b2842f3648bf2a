"""Test-wide setup: 8 simulated CPU devices and a persistent compilation cache."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "bdlm_jax_xla"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
