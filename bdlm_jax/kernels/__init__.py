"""Attention implementations behind one interface (see kernels/xla.py for its contract)."""

from bdlm_jax.config import ConfigError
from bdlm_jax.kernels import xla
from bdlm_jax.kernels.mask import CLEAN, NOISY, RowMeta, allowed


def get_kernel(name: str):
  """The module implementing `attend`, `attend_fwd` and `attend_bwd` for `name`."""
  if name == "xla":
    return xla
  if name == "pallas":
    from bdlm_jax.kernels import pallas
    return pallas
  raise ConfigError(f"unknown model.attention_impl {name!r}; valid: 'xla', 'pallas'")


__all__ = ["get_kernel", "RowMeta", "allowed", "NOISY", "CLEAN", "xla"]
