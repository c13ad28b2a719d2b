"""Triton kernels of zero_ext (installed as ``zero_ext.kernels``): fused cast/scale and fp32 accumulate.

They run compiled on CUDA and, with ``TRITON_INTERPRET=1`` set before this import, on CPU tensors
through Triton's interpreter (how the tests run them on every machine). Each is also registered as a
``torch.ops.zero_ext.*`` op via ``torch.library.triton_op`` so torch.compile'd code can call it.
"""

from .accumulate import accumulate_
from .cast_scale import cast_scale

__all__ = ["cast_scale", "accumulate_"]
