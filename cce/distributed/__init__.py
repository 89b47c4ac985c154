"""Distributed linear cross entropy: vocabulary parallelism over ``torch.distributed``
(vocab_parallel.py, with its collectives and set-up check) and FSDP2-sharded heads (fsdp.py).
docs/distributed.md explains both."""

from .fsdp import call_unsharded, lm_head_linear_cross_entropy
from .vocab_parallel import (
    linear_cross_entropy_vocab_parallel,
    vocab_parallel_sharded_tokens,
    vocab_parallel_with_options,
)

__all__ = [
    "call_unsharded",
    "linear_cross_entropy_vocab_parallel",
    "lm_head_linear_cross_entropy",
    "vocab_parallel_sharded_tokens",
    "vocab_parallel_with_options",
]
