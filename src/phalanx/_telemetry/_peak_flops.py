"""The peak FLOP/s of one accelerator, by JAX's `device_kind`, for model
FLOPs utilisation (`Throughput`'s ``mfu``): dense (not 2:4 sparse) matrix
throughput, per JAX device, from the vendors' data sheets.

Two columns: half precision (bfloat16 and float16) and float32 as JAX runs
a float32 matrix multiply at its default precision: on NVIDIA GPUs from
Ampere on, as TF32 on the tensor cores; on TPUs, as one bfloat16 pass (so
both columns are the same there). A device not in the table has no peak
here: pass ``Throughput(peak_flops=...)``.
"""

import jax.numpy as jnp
import numpy as np


# (device_kind contains this, case folded; half-precision peak; float32 peak),
# the more specific names first. Sources:
# - A100: NVIDIA A100 Tensor Core GPU data sheet (2021): BF16 312 TFLOPS,
#   TF32 156 TFLOPS dense (SXM and PCIe alike).
# - H100: NVIDIA H100 Tensor Core GPU data sheet (2023), dense = half the
#   "with sparsity" figures: SXM BF16 989 TFLOPS, TF32 495; PCIe BF16 756,
#   TF32 378; NVL BF16 835, TF32 418.
# - H200: NVIDIA H200 Tensor Core GPU product brief (2024): SXM as H100 SXM
#   (BF16 989, TF32 495 dense); NVL BF16 835, TF32 418.
# - B200: NVIDIA HGX B200 spec (2024), per GPU, dense = half the sparse
#   figures: BF16 2.25 PFLOPS, TF32 1.1 PFLOPS.
# - TPU v4: 275 TFLOPS bf16 per chip (cloud.google.com/tpu/docs/v4).
# - TPU v5e ("TPU v5 lite"): 197 TFLOPS bf16 per chip (.../tpu/docs/v5e).
# - TPU v5p ("TPU v5"): 459 TFLOPS bf16 per chip (.../tpu/docs/v5p).
# - TPU v6e ("TPU v6 lite", Trillium): 918 TFLOPS bf16 per chip
#   (.../tpu/docs/v6e).
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("a100", 312e12, 156e12),
    ("h100 pcie", 756e12, 378e12),
    ("h100 nvl", 835e12, 418e12),
    ("h100", 989e12, 495e12),
    ("h200 nvl", 835e12, 418e12),
    ("h200", 989e12, 495e12),
    ("b200", 2.25e15, 1.1e15),
    ("tpu v4", 275e12, 275e12),
    ("tpu v5 lite", 197e12, 197e12),
    ("tpu v5e", 197e12, 197e12),
    ("tpu v5p", 459e12, 459e12),
    ("tpu v5", 459e12, 459e12),
    ("tpu v6 lite", 918e12, 918e12),
    ("tpu v6e", 918e12, 918e12),
)


def peak_flops(device_kind: str, compute: np.dtype) -> float | None:
    """The peak FLOP/s of one device of `device_kind` (e.g. ``"NVIDIA
    H100 80GB HBM3"``) for matrix multiplies in `compute` (the precision's
    compute dtype); None where the table has no such device (a CPU) or
    dtype (float64)."""
    kind = device_kind.casefold()
    half = compute in (jnp.bfloat16, jnp.float16)
    if not half and compute != jnp.float32:
        return None
    for name, half_peak, float32_peak in PEAKS:
        if name in kind:
            return half_peak if half else float32_peak
    return None
