"""RMSNorm as a function, for the modules that hold their norm weights themselves."""

import jax
import jax.numpy as jnp


def rms_norm(x, eps: float, scale=None):
  """x / rms(x), times `scale` if given, computed in float32 and cast back (as Hugging
  Face's Llama/Qwen3/Gemma norms; Gemma 4's weightless ones pass no scale)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if scale is not None:
    x32 = x32 * scale.astype(jnp.float32)
  return x32.astype(x.dtype)
