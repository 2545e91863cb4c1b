"""`aten::_grouped_mm` on meta and fake tensors in every dtype its real kernels take.

transformers' experts (`@use_experts_implementation`, whose default implementation
is `grouped_mm`) call `torch.nn.functional.grouped_mm`, i.e. `aten::_grouped_mm`,
in the model's own dtype. Its real kernels take float32, float16 and bfloat16
alike: on CUDA, bfloat16 takes the CUTLASS fast path and the others a loop of
`mm` (`_grouped_mm_fallback`); on CPU, one kernel takes all three. The output's
shape does not depend on the dtype. torch's meta function, which fake tensors
use too, checks only the CUDA fast path's condition (bfloat16), so a float32
MoE cannot be simulated on meta or fake tensors, and one above the values limit
cannot be simulated at all.

`accept_real_dtypes()` gives the op a meta kernel that accepts what the real
kernels accept (one of the three dtypes, the same on both sides; anything else
fails as the real kernel does) and returns torch's own output tensor for it
(`_create_grouped_mm_output_tensor`, what torch's meta function returns for
bfloat16, which still goes through that function). Nothing else changes: the
model runs the code the GPU runs, the same op on the same shapes, so the
collectives around it (the experts module's hooks, DTensor redistributions of
its output) are the ones of the real run.

It stays registered for the rest of the process: torch cannot take it back
cleanly (after the override is destroyed, fake tensors still dispatch to it),
and a kernel that agrees with the real ones has nothing to take back.
"""

from __future__ import annotations

_ACCEPTED = ("float32", "float16", "bfloat16")
_library = None  # the registration lives as long as this object


def accept_real_dtypes() -> None:
    """Register the meta kernel (once per process; later calls do nothing)."""
    global _library
    if _library is not None:
        return
    import torch

    library = torch.library.Library("aten", "IMPL")
    # over torch's own Python meta kernel, which older torch releases register (2.11 does)
    library.impl("_grouped_mm", _meta, "Meta", allow_override=True)
    _library = library


def _meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch's meta function for bfloat16; for float32 and float16, its checks of the
    non-scaled op (layout, strides, offsets: the real kernels make them too) with the
    real kernels' dtype check in place of the fast path's, and its output tensor."""
    import torch
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    check = torch._check
    # at::native::_grouped_mm_validate_inputs, the CPU and CUDA kernels' own check
    check(str(mat_a.dtype).removeprefix("torch.") in _ACCEPTED,
          lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {mat_a.dtype}")
    check(mat_a.dtype == mat_b.dtype, lambda: f"expected mat_a and mat_b to have the same dtype, got {mat_a.dtype} and {mat_b.dtype}")
    check(out_dtype is None or out_dtype == mat_a.dtype, lambda: f"out_dtype {out_dtype} differs from the inputs' {mat_a.dtype}")
    # the rest as torch's _meta_grouped_mm_common without scales
    check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
          lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}")
    if mat_a.dim() == 3 or mat_b.dim() == 3:
        check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    if mat_a.dim() == 2 or mat_b.dim() == 2:
        check(offs is not None, lambda: f"Offsets tensor not provided, but is needed for {mat_a.dim()}D/{mat_b.dim()}D multiplicand layouts.")
        check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: f"Offsets tensor must be a 1D int32 tensor, got {offs.dim()}D {offs.dtype}.")
    else:
        check(offs is None, lambda: "Offsets tensor provided, but is not needed for 3D/3D multiplicand layouts.")
    check(bias is None, lambda: "Bias tensor provided, but it is not supported yet.")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


def _check_strides(name: str, mat) -> None:
    """Row- or column-major in the last two dims, the leading stride a multiple of 16 bytes."""
    import torch

    last, alignment, stride = mat.dim() - 1, 16 // mat.element_size(), mat.stride()
    if stride[last - 1] == 1 and stride[last] >= max(1, mat.shape[last - 1]):
        torch._check(stride[last] % alignment == 0, lambda: f"Expected {name} stride along {last} dim to be multiple of 16 bytes, got {stride[last]}.")
    elif stride[last] == 1 and stride[last - 1] >= max(1, mat.shape[last]):
        torch._check(stride[last - 1] % alignment == 0,
                     lambda: f"Expected {name} stride along {last - 1} dim to be multiple of 16 bytes, got {stride[last - 1]}.")
    else:
        torch._check(False, lambda: f"Invalid strides/sizes, got {stride} for strides and {mat.shape} for sizes.")
