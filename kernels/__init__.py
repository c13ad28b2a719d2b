"""Triton kernels of zero_ext (installed as ``zero_ext.kernels``): fused cast/scale and fp32 accumulate.

They run compiled on CUDA and, with ``TRITON_INTERPRET=1`` set before this import, on CPU tensors
through Triton's interpreter (how the tests run them on every machine). Each is also registered as a
``torch.ops.zero_ext.*`` op via ``torch.library.triton_op`` so torch.compile'd code can call it.
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # CUDA builds of torch bring Triton; a CPU-only install may not have it
    raise ImportError(
        "zero_ext.kernels needs Triton: `pip install triton` (or install zero_ext with the [dev] extra); "
        "the rest of zero_ext works without it on CPU"
    ) from e

from .accumulate import accumulate_  # noqa: E402
from .cast_scale import cast_scale  # noqa: E402

__all__ = ["cast_scale", "accumulate_"]
