"""Where each Pallas kernel compiles, and so where it runs in interpret mode instead."""

COMPILED_ON = {"pallas": "gpu", "splash": "tpu"}  # model.attention_impl -> its backend


def interpreted(name: str, backend: str) -> bool:
  """Whether kernel `name` runs in Pallas' interpret mode on `backend` (jax's default): a
  correctness path, much slower than compiled code."""
  return name in COMPILED_ON and COMPILED_ON[name] != backend
