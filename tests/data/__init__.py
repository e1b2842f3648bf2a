"""Tests of bdlm_jax.data."""
