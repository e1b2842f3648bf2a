"""Attention implementations behind one interface (see kernels/xla.py for its contract)."""

from bdlm_jax.errors import ConfigError
from bdlm_jax.kernels import xla
from bdlm_jax.kernels.interpret import COMPILED_ON, interpreted
from bdlm_jax.kernels.mask import CLEAN, NOISY, RowMeta, allowed, windowed


def get_kernel(name: str):
  """The module implementing `attend`, `attend_fwd` and `attend_bwd` for `name`."""
  if name == "xla":
    return xla
  if name == "pallas":
    from bdlm_jax.kernels import pallas
    return pallas
  if name == "splash":
    from bdlm_jax.kernels import splash
    return splash
  raise ConfigError(f"unknown model.attention_impl {name!r}; valid: 'xla', 'pallas', 'splash'")


def with_windows(attend, block_size: int):
  """The model's `attend(q, k, v, q_meta, k_meta, window=None)` from a kernel's `attend` over
  one device's rows: a local layer's window W becomes its queries' window starts."""
  def attend_layer(q, k, v, q_meta, k_meta, window=None):
    if window is not None:
      q_meta = windowed(q_meta, window, block_size)
    return attend(q, k, v, q_meta, k_meta)
  return attend_layer


__all__ = ["get_kernel", "interpreted", "with_windows", "RowMeta", "allowed", "NOISY", "CLEAN", "xla"]
