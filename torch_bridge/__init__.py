"""torch_bridge: optax_half's low-precision optimizers for PyTorch.

So far: ``torch_bridge.rounding``, the bit-level primitives (split fp32 master,
counter-based random bits, stochastic rounding) that produce the same bits as
``optax_half.rounding`` for the same integer seed. The optimizers follow.
"""

from torch_bridge import rounding

__all__ = ["rounding"]
