"""`sharded_model`: a model built in the shards a strategy keeps it in, so
that it is never whole on one device.

The model's constructor runs inside `jax.jit` with the strategy's layout as
its output shardings: each device computes (and holds) only its part.
"""

from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._keys import Builder, with_key
from .._state._train_state import TrainState
from .._typing import validates_own_arguments
from ._strategy import Strategy


_Model = TypeVar("_Model", bound=eqx.Module)


@validates_own_arguments
def sharded_model(
    make_model: Builder[_Model],
    strategy: Strategy,
    *,
    key: PRNGKeyArray,
) -> _Model:
    """``make_model(key)``, its arrays made where `strategy` keeps them.

    The same model as ``make_model(key)`` (the same values: the same
    operations under `jax.jit`), but a split array is never whole on one
    device, not even while it is built: for a model too large for one
    device. Hand it to `DataParallelTrainer` with the same strategy; the
    trainer keeps it where it is.

    Example:
        ```python
        strategy = px.MeshStrategy(data=1, fsdp=8)
        model = px.sharded_model(lambda k: Net(k), strategy, key=jax.random.key(0))
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), strategy=strategy)
        ```

    Args:
        make_model: builds the model from a key (traced: it must not read
            the arrays' values on the host): called as
            ``make_model(key=...)`` where it has a parameter named ``key``
            (as Equinox's models do, e.g.
            ``functools.partial(eqx.nn.MLP, 784, 10, 256, 2)``), else as
            ``make_model(key)`` (e.g. ``lambda k: Net(k)``).
        strategy: where the arrays go (its `state_shardings`).
        key: the key `make_model` gets.

    Raises:
        TypeError: `make_model` is not callable or takes no argument, or
            `strategy` is not a strategy.
    """
    if not callable(make_model):
        raise TypeError(
            f"make_model={make_model!r} is not callable; pass a function "
            "key -> model, e.g. lambda key: Net(key)"
        )
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"strategy={strategy!r} is not a phalanx strategy, e.g. "
            "px.MeshStrategy(fsdp=8)"
        )

    build = with_key(make_model, "make_model")

    def arrays(key: PRNGKeyArray) -> _Model:
        return eqx.filter(build(key), eqx.is_array)

    def skeleton(key: PRNGKeyArray) -> TrainState[_Model]:
        # The state's shape, to ask the strategy where the model's arrays go.
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            model=arrays(key),
            opt_state=(),
            key=key,
        )

    shardings = strategy.state_shardings(jax.eval_shape(skeleton, key)).model
    made = jax.jit(arrays, out_shardings=shardings)(key)
    shape = eqx.filter_eval_shape(build, key)
    return eqx.combine(made, eqx.filter(shape, eqx.is_array, inverse=True))
