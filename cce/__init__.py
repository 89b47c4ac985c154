"""cce: fused linear + cross-entropy ("cut cross entropy") for large-vocabulary language models.

    loss = cce.linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)

computes ``F.cross_entropy(hidden @ lm_head.weight.T, labels)`` without materializing the logits;
``cce.explain(hidden, lm_head.weight, labels, shift=True)`` says which path that call takes and why.
``cce.cross_entropy(logits, labels)`` is the fused loss for callers that already hold the logits.
Hugging Face models: ``cce.transformers.patch(model)``; vocabulary parallelism:
``cce.distributed``. Both are imported on first use (``import cce.transformers``).
"""

from ._dispatch import LinearPlan
from .ops.cross_entropy import CausalLMLoss, CrossEntropyLoss, cross_entropy, cross_entropy_with_options
from .ops.linear_ce import (
    LinearCrossEntropy,
    explain,
    linear_cross_entropy,
    linear_cross_entropy_with_options,
)
from .options import CCEOptions, Tuning
from .outputs import LossOutputs

__all__ = [
    "CCEOptions",
    "CausalLMLoss",
    "CrossEntropyLoss",
    "LinearCrossEntropy",
    "LinearPlan",
    "LossOutputs",
    "Tuning",
    "cross_entropy",
    "cross_entropy_with_options",
    "explain",
    "linear_cross_entropy",
    "linear_cross_entropy_with_options",
]

__version__ = "0.1.0"
