"""Linear cross entropy (hidden states and classifier weight): the public function and module
(api.py), the chunked PyTorch implementation (chunked.py, cpu_filter.py, torch_impl.py), the
Triton one (triton_impl.py, triton_backward.py, kernels/), the row orders (rows.py) and the
per-block interface of vocabulary parallelism (local.py)."""

from .api import LinearCrossEntropy, explain, linear_cross_entropy, linear_cross_entropy_with_options

__all__ = ["LinearCrossEntropy", "explain", "linear_cross_entropy", "linear_cross_entropy_with_options"]
