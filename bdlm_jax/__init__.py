"""bdlm_jax: block diffusion language models with block parallelism, in JAX.

The public functional API (docs/usage.md, "Use it from Python"); everything is a pure function
of a params pytree, so it composes with jax.jit and jax.grad.
"""

from bdlm_jax.batch import Batch, abstract_batch, make_batch
from bdlm_jax.checkpoint.hf_export import export_hf
from bdlm_jax.checkpoint.hf_import import import_hf
from bdlm_jax.config import Config
from bdlm_jax.configure import load_config, override
from bdlm_jax.drafting import draft_proposals
from bdlm_jax.errors import ConfigError
from bdlm_jax.loss import ar_logits, canvas_logits, draft_logits, loss_fn
from bdlm_jax.params import init_params
from bdlm_jax.parallel.mesh import make_mesh
from bdlm_jax.sample import SampleStats, sample, sample_batch
from bdlm_jax.train import TrainState, abstract_state, init_state, make_train_step

__all__ = ["Batch", "Config", "ConfigError", "SampleStats", "TrainState", "abstract_batch",
           "abstract_state", "ar_logits", "canvas_logits", "draft_logits", "draft_proposals",
           "export_hf", "import_hf", "init_params", "init_state", "load_config", "loss_fn",
           "make_batch", "make_mesh", "make_train_step", "override", "sample", "sample_batch"]
