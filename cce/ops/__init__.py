"""The ops: one folder per level (linear_ce: hidden states and classifier; cross_entropy: logits),
each with its public function, its PyTorch and Triton implementations and their kernels."""
