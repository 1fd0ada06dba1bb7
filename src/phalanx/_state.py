from typing import Generic, TypeVar, final

import equinox as eqx
import optax
from jaxtyping import Array, Int, PRNGKeyArray


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
        model_state: `eqx.nn.State` for stateful layers (BatchNorm), else None.
    """

    step: Int[Array, ""]
    model: _Model
    opt_state: optax.OptState
    key: PRNGKeyArray
    model_state: eqx.nn.State | None = None
