"""Checkpointing: Orbax-managed train state, data iterator state and config per step."""

from bdlm_jax.checkpoint.manager import CheckpointError, Checkpointer, restore_state

__all__ = ["Checkpointer", "CheckpointError", "restore_state"]
