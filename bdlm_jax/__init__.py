"""bdlm_jax: block diffusion language models with block parallelism, in JAX."""
