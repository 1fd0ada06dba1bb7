"""`TrainState`, everything a run carries from one step to the next, and the
dynamic loss scale it may hold.

Both are immutable `eqx.Module` values: a step takes one and returns a new
one. This module only declares them: where each array lives is the
strategy's `state_shardings`, and nothing here places, copies or donates
arrays, or knows of the trainer."""

import dataclasses
from typing import ClassVar, Generic, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray


_Model = TypeVar("_Model", bound=eqx.Module)


@final
class TrainState(eqx.Module, Generic[_Model]):
    """Everything a training run carries from one step to the next.

    State goes into a step and a new state comes out; nothing hides on the
    trainer. Each array lives where the strategy's `state_shardings` says
    (replicated on every device, or split over them), and a state
    moves between strategies and device counts unchanged.

    Attributes:
        step: optimizer updates made so far.
        model: the Equinox model, parameters included.
        opt_state: the optax optimizer state.
        key: the PRNG key the next step draws from.
        lr_scale: the multiplier of the optimizer's final update (float32,
            1.0 unless changed): for optax's optimizers, whose last
            transform is the learning rate, it multiplies the rate, a
            schedule's included. `ReduceLROnPlateau` lowers it and
            `DataParallelTrainer.find_lr` sweeps it; being state, it is
            checkpointed and resumed with the rest.
        model_state: `eqx.nn.State` for stateful layers (BatchNorm), else None.
        loss_scale: the dynamic loss scale of a float16 run
            (``Precision(loss_scale="dynamic")``), else None.
        ema: with ``DataParallelTrainer(ema=decay)``, the exponential moving
            average of the model's parameters (its floating-point arrays;
            its other leaves None), laid out as the parameters are; else
            None. `averaged_model` is the model with them.
    """

    step: Int[Array, ""]
    model: _Model
    opt_state: optax.OptState
    key: PRNGKeyArray
    # Before the fields a run may lack, so that a checkpoint of a run that
    # had one of them differs from this one's state there, by name. A fresh
    # array for each state (the state's buffers are donated).
    lr_scale: Float[Array, ""] = eqx.field(
        default_factory=lambda: jnp.ones((), jnp.float32)
    )
    model_state: eqx.nn.State | None = None
    loss_scale: "DynamicScale | None" = None
    ema: _Model | None = None

    @property
    def averaged_model(self) -> _Model:
        """The model with the moving average of its parameters in place of
        them, where the state keeps one (`ema`); else the model itself."""
        if self.ema is None:
            return self.model
        rest = eqx.filter(self.model, eqx.is_inexact_array, inverse=True)
        return eqx.combine(self.ema, rest)

    def averaged(self, decay: float) -> "TrainState[_Model]":
        """This state with its `ema` moved towards its parameters:
        ``ema ← decay · ema + (1 - decay) · parameters``."""
        assert self.ema is not None, "a state without an average keeps none"
        params = eqx.filter(self.model, eqx.is_inexact_array)
        ema = jax.tree.map(
            lambda e, p: (decay * e + (1 - decay) * p).astype(e.dtype),
            self.ema,
            params,
        )
        return dataclasses.replace(self, ema=ema)


@final
class DynamicScale(eqx.Module):
    """A dynamic loss scale: the factor the loss is multiplied by before
    differentiation, and the good steps since it last changed.

    A step whose scaled gradient is not finite is skipped and halves the
    scale (down to `MIN`); `PERIOD` good steps in a row double it.
    """

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]

    INITIAL: ClassVar[float] = 2.0**15
    PERIOD: ClassVar[int] = 2000
    MIN: ClassVar[float] = 1.0

    @classmethod
    def initial(cls) -> "DynamicScale":
        return cls(jnp.asarray(cls.INITIAL, jnp.float32), jnp.asarray(0, jnp.int32))

    def next(self, finite: Bool[Array, ""]) -> "DynamicScale":
        """The scale after a step whose (scaled) gradient was `finite` or not."""
        grown = self.good_steps + 1 >= self.PERIOD
        scale = jnp.where(
            finite,
            jnp.where(grown, self.scale * 2, self.scale),
            jnp.maximum(self.scale / 2, self.MIN),
        )
        good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
        return DynamicScale(scale.astype(self.scale.dtype), good.astype(jnp.int32))
