"""Mixed precision: the dtype each part of a train step computes in."""

import dataclasses
import math
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from ._typing import validates_own_arguments


LossScale: TypeAlias = None | Literal["dynamic"] | float
PrecisionName: TypeAlias = Literal["fp32", "bf16", "fp16"]


@final
@dataclasses.dataclass(frozen=True, init=False)
class Precision:
    """Which dtype each part of a train step uses (a mixed-precision policy).

    The step casts the model's floating parameters and the batch's floating
    inputs to `compute` for the forward and backward pass, the model's
    outputs to `output` before the loss, and the gradients back to `params`;
    parameters and optimizer state are kept in `params` throughout (the
    float32 "master weights"). Integer leaves, PRNG keys and model state
    (BatchNorm statistics) keep their dtype. The gradients cross devices in
    `reduce`.

    Example:
        ```python
        px.Precision(compute=jnp.bfloat16)  # what precision="bf16" means
        px.Precision(compute=jnp.bfloat16, reduce=jnp.bfloat16)  # half the bytes
        ```

    Attributes:
        params: the dtype floating parameters and optimizer state are kept in.
        compute: the forward and backward pass's dtype.
        output: the model's outputs are cast to it before the loss.
        reduce: the dtype of the cross-device gradient reduction.
        loss_scale: None; a fixed factor the loss is multiplied by before
            differentiation (and the gradients divided by after); or
            ``"dynamic"``: a factor that halves on a non-finite gradient
            (that step's update is skipped) and doubles after
            `DynamicScale.PERIOD` (2000) good steps in a row, for float16.

    Raises:
        TypeError: a dtype is not a floating one.
        ValueError: a dtype JAX would not honour (``float64`` without 64-bit
            mode: ``jax.config.update("jax_enable_x64", True)``), or a bad
            `loss_scale`.
    """

    params: Any
    compute: Any
    output: Any
    reduce: Any
    loss_scale: LossScale

    @validates_own_arguments
    def __init__(
        self,
        params: Any = jnp.float32,
        compute: Any = jnp.float32,
        output: Any = jnp.float32,
        reduce: Any = jnp.float32,
        loss_scale: LossScale = None,
    ):
        given = {"params": params, "compute": compute, "output": output}
        for field, value in {**given, "reduce": reduce}.items():
            try:
                dtype = jnp.dtype(value)
            except TypeError:
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"Precision({field}={value!r}) must be a floating dtype, e.g. "
                    "jnp.float32, jnp.bfloat16 or jnp.float16"
                )
            # Without 64-bit mode JAX computes float64 in float32, silently.
            runs_in = jax.dtypes.canonicalize_dtype(dtype)
            if runs_in != dtype:
                raise ValueError(
                    f"Precision({field}={value!r}) asks for {dtype.name}, which JAX "
                    f"computes in {runs_in.name} unless 64-bit mode is on; turn it "
                    "on first, jax.config.update('jax_enable_x64', True) at the top "
                    "of the script (or JAX_ENABLE_X64=1), or use jnp.float32"
                )
            object.__setattr__(self, field, dtype)
        scale = loss_scale
        if not (
            scale is None
            or scale == "dynamic"
            or (
                isinstance(scale, int | float)
                and not isinstance(scale, bool)
                and math.isfinite(scale)
                and scale > 0
            )
        ):
            raise ValueError(
                f"Precision(loss_scale={scale!r}) must be None, 'dynamic' or a "
                "positive finite number, e.g. loss_scale='dynamic' for float16"
            )
        object.__setattr__(self, "loss_scale", scale)

    @property
    def mixed(self) -> bool:
        """Whether anything differs from computing in `params` throughout."""
        return self != Precision(self.params, self.params, self.params, self.params)

    def cast(self, tree: PyTree, dtype: Any) -> PyTree:
        """`cast_floating(tree, dtype)` under a mixed policy; `tree` as it is
        otherwise (the step is then the same program as without a policy)."""
        return cast_floating(tree, dtype) if self.mixed else tree

    def describe(self) -> str:
        """A short name: the preset's, or the dtypes."""
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return (
            f"params={self.params.name}, compute={self.compute.name}, output="
            f"{self.output.name}, reduce={self.reduce.name}, loss_scale="
            f"{self.loss_scale!r}"
        )


PRESETS: dict[str, Precision] = {
    "fp32": Precision(),
    "bf16": Precision(compute=jnp.bfloat16),
    "fp16": Precision(compute=jnp.float16, loss_scale="dynamic"),
}


def precision_of(value: Any) -> Precision:
    """The `Precision` a trainer's ``precision`` argument names.

    Raises:
        TypeError, ValueError: `value` is neither a preset's name nor a
            `Precision`.
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        if value in PRESETS:
            return PRESETS[value]
        raise ValueError(
            f"precision={value!r} is not a preset; use one of "
            f"{', '.join(map(repr, PRESETS))}, or a px.Precision(...)"
        )
    raise TypeError(
        f"precision={value!r} must be 'fp32', 'bf16', 'fp16' or a px.Precision"
    )


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """`tree` with its real floating-point arrays cast to `dtype` (integer,
    complex and key arrays, and everything else, as they are)."""

    def cast(x: Any) -> Any:
        if (
            eqx.is_array(x)
            and jnp.issubdtype(x.dtype, jnp.floating)
            and x.dtype != dtype
        ):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
