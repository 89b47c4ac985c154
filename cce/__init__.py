"""cce: fused linear + cross-entropy ("cut cross entropy") for large-vocabulary language models.

    loss = cce.linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)

computes ``F.cross_entropy(hidden @ lm_head.weight.T, labels)`` without materializing the logits.
"""

from .linear import LinearCrossEntropy, linear_cross_entropy
from .options import CCEOptions

__all__ = [
    "CCEOptions",
    "LinearCrossEntropy",
    "linear_cross_entropy",
]

__version__ = "0.1.0"
