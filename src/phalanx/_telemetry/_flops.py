"""`StepFlops`: the floating-point operations of one train step, as a value
(counted by the engine, read by callbacks, the summary and the CLI)."""

from typing import NamedTuple


class StepFlops(NamedTuple):
    """The floating-point operations of one train step: its matrix
    multiplies and convolutions, forward and backward, over the global batch.

    Counted from the step's program (its jaxpr, the program XLA compiles),
    never run: ``2·m·n·k`` per matrix multiply, ``2`` per multiply-add of a
    convolution, a ``lax.scan``'s body times its length (microbatches,
    `Stacked` layers), the larger branch of a ``lax.cond``, a `while_loop`'s
    body once (its trip count is not known). Elementwise work (activations,
    the optimizer's update) is left out: as in the ``6·params·tokens``
    convention, and as in the peak figures of accelerators' matrix units
    that model FLOPs utilisation divides by.

    Attributes:
        total: the step's operations over all devices.
        devices: the devices the step runs on.
        size: the examples of the global step it was counted for.
    """

    total: float
    devices: int
    size: int

    @property
    def per_device(self) -> float:
        """Each device's share: `total` over `devices` (data parallelism
        splits every multiply evenly; work a device repeats is not counted)."""
        return self.total / self.devices

    def short(self) -> str:
        """E.g. ``"258 MFLOPs per step (32.2 MFLOPs per device)"``."""
        return (
            f"{format_flops(self.total)} per step "
            f"({format_flops(self.per_device)} per device)"
        )


def format_flops(n: float) -> str:
    """`n` operations with a unit, 3 significant figures: ``"258 MFLOPs"``."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOPs"


_UNITS = (("PFLOPs", 1e15), ("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6))
