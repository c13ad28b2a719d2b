"""Triton kernels of zero_ext (``zero_ext.kernels``: setup.py installs this folder under that name): fused cast/scale
and fp32 accumulate, and ``dispatch``, which picks them or the C++ kernels by the tensors' device.

They run compiled on CUDA and, with ``TRITON_INTERPRET=1`` set before this import, on CPU tensors through
Triton's interpreter (how the tests run them on every machine). Each is also registered as a
``torch.ops.zero_ext.*`` op via ``torch.library.triton_op`` so torch.compile'd code can call it.

Without Triton (a CPU-only install may lack it) ``zero_ext.kernels.dispatch``, which is what the engine calls,
still works on CPU tensors; only these two names raise an ImportError saying how to get Triton.
"""

__all__ = ["cast_scale", "accumulate_"]

try:
    import triton  # noqa: F401
except ImportError:  # CUDA builds of torch bring Triton; a CPU-only install may not have it

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(
                f"zero_ext.kernels.{name} needs Triton: `pip install triton` (or install zero_ext with the [dev] "
                "extra); the rest of zero_ext works without it on CPU"
            )
        raise AttributeError(f"module 'zero_ext.kernels' has no attribute {name!r}")

else:
    # Imported here, not on first use: the submodules share the functions' names, and a submodule imported
    # later would replace the function as the package attribute.
    from .accumulate import accumulate_
    from .cast_scale import cast_scale
