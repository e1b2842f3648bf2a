"""Data: tokenizers, random-access sources and the packed, checkpointable Grain pipeline."""

from bdlm_jax.data.arithmetic import ArithmeticSource, check_arithmetic
from bdlm_jax.data.pipeline import make_dataset
from bdlm_jax.data.sources import DataError, make_source
from bdlm_jax.data.tokenizers import ByteTokenizer, HFTokenizer, make_tokenizer

__all__ = ["make_dataset", "make_tokenizer", "make_source", "ByteTokenizer", "HFTokenizer",
           "ArithmeticSource", "check_arithmetic", "DataError"]
