"""Cross entropy over logits the caller already holds: the public function and modules (api.py),
the chunked PyTorch row passes (torch_impl.py), the Triton kernels (kernels.py, triton_impl.py)
and the custom ops both share (autograd.py)."""

from .api import CausalLMLoss, CrossEntropyLoss, cross_entropy, cross_entropy_with_options

__all__ = ["CausalLMLoss", "CrossEntropyLoss", "cross_entropy", "cross_entropy_with_options"]
