"""Hand-written training loops: the baselines phalanx is measured against.

Each is what a researcher would write by hand for the same job, tuned fairly:
the Equinox model is split once into arrays and static parts (no
`eqx.filter_jit`, which waits on every call to report errors, so host work
never overlaps device work), the state travels
as a flat list of arrays, and its buffers are donated to the step. The step
returns the loss (a real loop logs it) but nothing waits for it.

- ``"jit"``: `jax.jit` over a batch split along a 1-D ``"data"`` mesh with
  `NamedSharding`, parameters replicated; the compiler adds the all-reduce.
- ``"pmap"``: `jax.pmap` with `jax.lax.pmean` of the gradients; the state
  carries a leading device axis and the batch is reshaped to
  ``[devices, per_device, ...]``.
- ``"scan"``: gradient accumulation, `jax.jit` of `jax.shard_map`: each device
  runs a local `jax.lax.scan` over its `microbatches`, summing loss and
  gradients, then one `jax.lax.psum`, and a single division by the global
  batch size.

The model is the benchmark's MLP (784-256-128-10, or 16-16-4 with
``--model tiny``) with adam(1e-3) and the mean softmax cross-entropy against
integer labels.
"""

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import phalanx as px


KINDS = ("jit", "jit-guarded", "pmap", "scan")


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """An MLP's input width, hidden widths and classes."""

    inputs: int
    hidden: tuple[int, ...]
    classes: int

    def describe(self) -> str:
        return "MLP " + "-".join(map(str, (self.inputs, *self.hidden, self.classes)))


# "mlp": steps of 2-20 ms on these CPUs, where a framework's fixed cost per
# step hides; "tiny": steps of tens of µs, as small models take on a GPU,
# where the host's work per step is the speed (issue 17).
SIZES = {
    "mlp": ModelSize(784, (256, 128), 10),
    "tiny": ModelSize(16, (16,), 4),
}
SIZE = SIZES["mlp"]  # the benchmark's model: `use_size` sets it


def use_size(name: str) -> None:
    """Make `SIZES[name]` the model of every later `make_model`."""
    global SIZE
    SIZE = SIZES[name]


def make_model(seed: int = 0) -> px.models.MLP:
    """The benchmark's model, the same for phalanx and the references."""
    return px.models.MLP(
        SIZE.inputs, SIZE.classes, hidden=SIZE.hidden, key=jax.random.key(seed)
    )


def make_optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-3)


def make_guarded_optimizer() -> optax.GradientTransformation:
    """`make_optimizer` as a careful hand-written loop guards it: an update
    whose gradient holds a NaN or inf is skipped (`optax.apply_if_finite`,
    never giving up on a run of them), as phalanx's ``nan_policy="skip"``."""
    return optax.apply_if_finite(make_optimizer(), max_consecutive_errors=2**31 - 1)


@dataclasses.dataclass
class Reference:
    """A hand-written loop: its state, its jitted step and its batch layout.

    Attributes:
        kind: ``"jit"``, ``"pmap"`` or ``"scan"``.
        state: the flat list of parameter and optimizer-state arrays.
        step_fn: ``step_fn(state, x, y) -> (state, loss)``, state donated.
        place: puts a host ``(x, y)`` batch on the devices in the layout
            `step_fn` expects.
        loss: the loss of the last step (not waited for).
        compile_time: seconds of the first `step` (tracing and compilation
            included), or None before it.
    """

    kind: str
    state: list[jax.Array]
    step_fn: Callable[..., tuple[list[jax.Array], jax.Array]]
    place: Callable[[np.ndarray, np.ndarray], tuple[jax.Array, jax.Array]]
    loss: jax.Array | None = None
    compile_time: float | None = None

    def step(self, batch: tuple[jax.Array, jax.Array]) -> None:
        """One update on a placed batch; returns without waiting for it."""
        if self.compile_time is None:
            start = time.perf_counter()
            self.state, self.loss = self.step_fn(self.state, *batch)
            jax.block_until_ready(self.state)
            self.compile_time = time.perf_counter() - start
        else:
            self.state, self.loss = self.step_fn(self.state, *batch)

    def block(self) -> None:
        """Wait until every dispatched step has finished."""
        jax.block_until_ready((self.state, self.loss))

    def lower(self, batch: tuple[jax.Array, jax.Array]) -> jax.stages.Lowered:
        """The step lowered for a placed `batch`, to inspect (not to run)."""
        return self.step_fn.lower(self.state, *batch)

    def compile(self, batch: tuple[jax.Array, jax.Array]) -> jax.stages.Compiled:
        """The step compiled for a placed `batch`, to inspect (not to run)."""
        return self.lower(batch).compile()


def make_reference(
    kind: str,
    devices: Sequence[jax.Device],
    batch_size: int,
    microbatches: int = 1,
) -> Reference:
    """A fresh reference loop (model initialised, nothing compiled yet).

    Args:
        kind: one of `KINDS`.
        devices: the devices to train on.
        batch_size: examples in a global batch.
        microbatches: parts each device's slice is split into (``"scan"``
            only; 1 elsewhere).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    if kind != "scan" and microbatches != 1:
        raise ValueError(f"kind={kind!r} does not accumulate; use microbatches=1")
    if batch_size % (len(devices) * microbatches):
        raise ValueError(
            f"{batch_size=} is not divisible by {len(devices)} devices × "
            f"{microbatches=}"
        )
    builders = {
        "jit": _jit,
        "jit-guarded": functools.partial(_jit, guarded=True),
        "pmap": _pmap,
        "scan": _scan,
    }
    return builders[kind](list(devices), batch_size, microbatches)


def _split_state(model: eqx.Module, optimizer: optax.GradientTransformation):
    """Flat state leaves, their treedef, and the model's static part."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten((params, optimizer.init(params)))
    return leaves, treedef, static


def _losses(params, static, x, y) -> jax.Array:
    """Per-example softmax cross-entropy of the model on a batch."""
    model = eqx.combine(params, static)
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _update(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _mesh(devices: list[jax.Device]) -> Mesh:
    return Mesh(np.array(devices), ("data",))


def _jit(
    devices: list[jax.Device],
    batch_size: int,
    microbatches: int,
    guarded: bool = False,
) -> Reference:
    """`jax.jit` over a sharded batch; the compiler adds the all-reduce
    (`guarded`: with `make_guarded_optimizer`)."""
    del batch_size, microbatches
    optimizer = make_guarded_optimizer() if guarded else make_optimizer()
    leaves, treedef, static = _split_state(make_model(), optimizer)
    mesh = _mesh(devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(leaves, x, y):
        params, opt_state = jax.tree.unflatten(treedef, leaves)

        def loss_fn(params):
            return jnp.mean(_losses(params, static, x, y))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        params, opt_state = _update(optimizer, params, opt_state, grads)
        return jax.tree.leaves((params, opt_state)), loss

    step_fn = jax.jit(step, donate_argnums=0, out_shardings=replicated)
    return Reference(
        "jit-guarded" if guarded else "jit",
        jax.device_put(leaves, replicated),
        step_fn,
        lambda x, y: jax.device_put((x, y), split),
    )


def _pmap(devices: list[jax.Device], batch_size: int, microbatches: int) -> Reference:
    """`jax.pmap` with a `pmean` of gradients; state has a device axis."""
    del microbatches
    n = len(devices)
    optimizer = make_optimizer()
    leaves, treedef, static = _split_state(make_model(), optimizer)
    split = NamedSharding(_mesh(devices), P("data"))

    def step(leaves, x, y):
        params, opt_state = jax.tree.unflatten(treedef, leaves)

        def loss_fn(params):
            return jnp.mean(_losses(params, static, x, y))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        loss, grads = jax.lax.pmean((loss, grads), "data")
        params, opt_state = _update(optimizer, params, opt_state, grads)
        return jax.tree.leaves((params, opt_state)), loss

    step_fn = jax.pmap(step, axis_name="data", devices=devices, donate_argnums=0)
    # One copy of the state per device, along a leading axis.
    stacked = [np.broadcast_to(np.asarray(leaf), (n, *leaf.shape)) for leaf in leaves]

    def place(x, y):
        per_device = batch_size // n
        batch = (x.reshape(n, per_device, *x.shape[1:]), y.reshape(n, per_device))
        return jax.device_put(batch, split)

    return Reference("pmap", jax.device_put(stacked, split), step_fn, place)


def _scan(devices: list[jax.Device], batch_size: int, microbatches: int) -> Reference:
    """`jax.shard_map`: a local scan over microbatches, then one `psum`."""
    k = microbatches
    optimizer = make_optimizer()
    leaves, treedef, static = _split_state(make_model(), optimizer)
    mesh = _mesh(devices)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def local_sums(params, x, y):
        """Σ loss and Σ gradients over this device's slice, k parts at a time."""
        xs = x.reshape(k, x.shape[0] // k, *x.shape[1:])
        ys = y.reshape(k, y.shape[0] // k)

        def summed_loss(params, x, y):
            return jnp.sum(_losses(params, static, x, y))

        def body(totals, microbatch):
            loss, grads = jax.value_and_grad(summed_loss)(params, *microbatch)
            return jax.tree.map(jnp.add, totals, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        totals, _ = jax.lax.scan(body, zeros, (xs, ys))
        return jax.lax.psum(totals, "data")

    # check_vma=False: the gradients taken inside stay this device's own, and
    # the one psum adds them up (with vma checks on, shard_map would already
    # sum the gradients of replicated params, and a psum on top would count
    # them N times).
    sums = jax.shard_map(
        local_sums,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
        check_vma=False,
    )

    def step(leaves, x, y):
        params, opt_state = jax.tree.unflatten(treedef, leaves)
        loss_sum, grad_sum = sums(params, x, y)
        grads = jax.tree.map(lambda g: g / batch_size, grad_sum)
        params, opt_state = _update(optimizer, params, opt_state, grads)
        return jax.tree.leaves((params, opt_state)), loss_sum / batch_size

    step_fn = jax.jit(step, donate_argnums=0, out_shardings=replicated)
    return Reference(
        "scan",
        jax.device_put(leaves, replicated),
        step_fn,
        lambda x, y: jax.device_put((x, y), split),
    )
