"""Shared test data, a hand-written reference trainer, and tree comparison."""

import functools as ft
import json
import pathlib
import re
import struct
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P
from typing_extensions import override

import phalanx as px
from phalanx.callbacks._wandb_log import transaction_log
from phalanx.cli._gloo_notes import _GLOO_NOTE
from phalanx.strategies._registry import Options, Registered, registered
from phalanx.strategies._strategy import AxisName, MeshSettings


IN, CLASSES, HIDDEN = 5, 3, (8,)


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n).astype(np.int32)
    return x, y


def make_model(seed: int = 0) -> px.models.MLP:
    return px.models.MLP(IN, CLASSES, hidden=HIDDEN, key=jr.key(seed))


def sqrt_loss(outputs, targets):
    # A target of -1 gives sqrt(-1) = NaN: finite inputs, non-finite gradients.
    return jnp.sum(outputs**2, axis=-1) * jnp.sqrt(targets.astype(jnp.float32))


def params_of(model) -> list[jax.Array]:
    return jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))


def host_arrays(tree) -> list[np.ndarray]:
    """Every array of `tree` (a model, a state) on the host, PRNG keys as
    their data."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    return [
        np.asarray(
            jax.random.key_data(leaf)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            else leaf
        )
        for leaf in leaves
    ]


def max_abs_diff(a, b) -> float:
    """Max |a - b| over the parameters of two models (or pytrees of arrays)."""
    la, lb = params_of(a), params_of(b)
    assert len(la) == len(lb)
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(la, lb, strict=True)
    )


def reference_fit(model, batches, steps: int, lr: float = 1e-2, optimizer=None):
    """One device, full batch, plain jax.jit: the update every strategy must
    match (adam(lr) unless another `optimizer` is given)."""
    optimizer = optax.adam(lr) if optimizer is None else optimizer
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y, w):
        def loss(params):
            logits = jax.vmap(eqx.combine(params, static))(x)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.sum(w * losses) / jnp.sum(w)

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    device = jax.devices()[0]
    for i in range(steps):
        x, y, *w = batches[i % len(batches)]  # (x, y) or (x, y, sample_weight)
        w = w[0] if w else np.ones(len(x), np.float32)
        x, y, w = jax.device_put((x, y, w), device)
        params, opt_state = step(params, opt_state, x, y, w)
    return eqx.combine(params, static)


def read_event_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every TensorBoard event file in `logdir`: tag -> [(step, value)].

    Parses the TFRecord framing (u64 length, u32 length CRC, payload, u32
    payload CRC) with tensorboardX's protobuf, so no TensorFlow is needed.
    """
    import pathlib
    import struct

    from tensorboardX.proto import event_pb2

    event_class = event_pb2.Event  # pyright: ignore[reportAttributeAccessIssue]
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 12
            event = event_class.FromString(data[offset : offset + length])
            offset += length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, value.simple_value)
                )
        assert offset == len(data), f"{path} ends inside a record"
    return scalars


def is_gloo_note(line: str) -> bool:
    """gloo's "[Gloo] Rank r is connected to n peer ranks..." note, or a piece
    of it: its C++ side sometimes writes the note in pieces, each on a line of
    its own (one was just the trailing count, "1"), and the line end can
    arrive alone (an empty line, rank-prefixed by the launcher)."""
    content = re.sub(r"^\[\d+\] ", "", line).strip()
    if "[Gloo]" in line or "peer ranks" in line or not content:
        return True
    return re.sub(r"\d+", "#", content) in _GLOO_NOTE


class StopAt(px.Callback):
    """Asks the fit to stop at the end of step `step`."""

    def __init__(self, step: int):
        self.step = step

    @override
    def on_step_end(self, info):
        if info.step == self.step:
            info.stop()


def count_host_waits(monkeypatch) -> list[str]:
    """The loop's waits for the device from now on (each `jax.device_get`
    and `jax.block_until_ready`, appended as they happen)."""
    waits: list[str] = []
    real_get, real_block = jax.device_get, jax.block_until_ready
    monkeypatch.setattr(jax, "device_get", lambda t: waits.append("get") or real_get(t))
    monkeypatch.setattr(
        jax, "block_until_ready", lambda t: waits.append("block") or real_block(t)
    )
    return waits


class RaiseAt(px.Callback):
    """Raises RuntimeError at the end of step `step` (a crash mid-fit), after
    the callbacks listed before it (it adds no metric, so it keeps its place
    among the loggers)."""

    def __init__(self, step: int):
        self.step = step

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return ()

    @override
    def on_step_end(self, info):
        if info.step == self.step:
            raise RuntimeError(f"boom at step {info.step}")


# The strategy test matrix, from the strategy registry (a strategy registered
# there is in it): each registered strategy and its variants ("zero2": a
# FullyShardedStrategy splitting the optimizer state only), alone and over 2
# and 4 microbatches ("fsdp+acc2"), each with min_size=1 where it splits the
# state (the test model's leaves are tiny). KINDS keep the state whole on
# every device, SHARDED_KINDS split it.
ACCUMULATE = (2, 4)
TINY = Options(min_size=lambda n: 1)


def bases(*, split: bool | None = None) -> dict[str, tuple[Registered, Options]]:
    """Each registered strategy and variant by kind (`split`: only those
    that split the state, or only those that do not), read when asked."""
    found = {}
    for entry in registered():
        if split is not None and entry.splits_state != split:
            continue
        found[entry.name] = (entry, TINY)
        for name, options in entry.variants.items():
            found[name] = (entry, TINY._replace(**_given(options)))
    return found


def _given(options: Options) -> dict:
    """The fields of `options` set away from their defaults."""
    return {
        field: value
        for field, value in options._asdict().items()
        if value != Options._field_defaults[field]
    }


def kinds(*, split: bool | None = None) -> tuple[str, ...]:
    """The matrix's kinds: every base alone, then over each of ACCUMULATE
    microbatches where its strategy accumulates."""
    found = bases(split=split)
    accumulated = [
        f"{kind}+acc{k}"
        for kind, (entry, _) in found.items()
        if entry.accumulates
        for k in ACCUMULATE
    ]
    return (*found, *accumulated)


KINDS = kinds(split=False)
SHARDED_KINDS = kinds(split=True)


def make_strategy(kind: str, devices: int) -> px.Strategy:
    base, _, acc = kind.partition("+")
    entry, options = bases()[base]
    inner = entry.build(devices, options)
    return px.AccumulatingStrategy(inner, int(acc[3:])) if acc else inner


def fits(kind: str, devices: int) -> bool:
    """Whether `kind`'s strategy suits `devices` devices (its entry says)."""
    entry, _ = bases()[kind.partition("+")[0]]
    return entry.fits(devices)


def one_of_each() -> dict[str, Callable[[], px.Strategy]]:
    """One of each registered strategy on 8 devices, and one accumulating,
    for tests that must hold under all of them."""
    made: dict[str, Callable[[], px.Strategy]] = {
        entry.name: ft.partial(entry.build, 8, TINY) for entry in registered()
    }
    made["accumulating"] = lambda: px.AccumulatingStrategy(px.PmapStrategy(4), 2)
    return made


# One of each strategy, for tests that must hold under all of them.
STRATEGIES = one_of_each()


class DropoutMLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]
    dropout: eqx.nn.Dropout

    def __init__(self, p: float, *, key):
        k1, k2 = jr.split(key)
        self.layers = (
            eqx.nn.Linear(IN, 16, key=k1),
            eqx.nn.Linear(16, CLASSES, key=k2),
        )
        self.dropout = eqx.nn.Dropout(p)

    def __call__(self, x, *, key):
        return self.layers[1](self.dropout(jax.nn.relu(self.layers[0](x)), key=key))


class BatchNormMLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]
    norm: eqx.nn.BatchNorm

    def __init__(self, axis_name, mode, *, key):
        k1, k2 = jr.split(key)
        self.layers = (
            eqx.nn.Linear(IN, 16, key=k1),
            eqx.nn.Linear(16, CLASSES, key=k2),
        )
        self.norm = eqx.nn.BatchNorm(16, axis_name=axis_name, mode=mode, momentum=0.5)

    def __call__(self, x, state):
        h, state = self.norm(self.layers[0](x), state)
        return self.layers[1](jax.nn.relu(h)), state


def wandb_parts(root: pathlib.Path) -> list[dict]:
    """Each local part of each run, in the order they started: its run id,
    config, history rows {step: {tag: value}} and exit code."""
    parts = []
    for path in (root / "wandb").glob("*/run-*.wandb"):
        if path.parent.is_symlink():  # "latest-run" links to one of the others
            continue
        part: dict = {"rows": {}, "exit_code": None}
        for record in transaction_log(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                part["id"] = record.run.run_id
                part["name"] = record.run.display_name
                part["start"] = record.run.start_time.ToNanoseconds()
                part["config"] = {
                    item.key: json.loads(item.value_json)
                    for item in record.run.config.update
                }
            elif kind == "history":
                items = {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
                step = items.pop("_step")
                assert step == record.history.step.num
                assert step not in part["rows"]
                part["rows"][step] = items
            elif kind == "exit":
                part["exit_code"] = record.exit.exit_code
            elif kind == "preempting":
                part["preempting"] = True
        parts.append(part)
    return sorted(parts, key=lambda part: part["start"])


def read_events(logdir: pathlib.Path) -> list:
    """Every event of every event file, from the TFRecord framing: u64 length,
    u32 length CRC, payload, u32 payload CRC."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 12
            events.append(
                event_pb2.Event.FromString(  # pyright: ignore[reportAttributeAccessIssue]
                    data[offset : offset + length]
                )
            )
            offset += length + 4
        assert offset == len(data)
    return events


def read_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event in read_events(logdir):
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


class RowsStrategy(px.strategies.DeviceMeshStrategy):
    """A strategy of the user's own, which the registry does not list: the
    batch over a 1-D mesh named "rows" (of `devices`, all by default), state
    replicated, every step per device; it declares mesh `settings` where it
    is given some."""

    mesh: Mesh
    axis_name: AxisName
    deterministic: bool
    settings: MeshSettings | None

    def __init__(self, devices=None, settings: MeshSettings | None = None):
        self.axis_name = "rows"
        devices = px.strategies.ShardingStrategy(devices).mesh.devices  # 1-D
        self.mesh = Mesh(devices, ("rows",))
        self.deterministic = False
        self.settings = settings

    @override
    def mesh_settings(self) -> MeshSettings | None:
        return self.settings

    @override
    def state_spec(self, role, leaf):
        del role, leaf
        return P()

    @override
    def reduce(self, fn, replicated, carry, examples):
        return self.reduce_per_device(fn, replicated, carry, examples)

    @override
    def map(self, fn, replicated, examples):
        return self.map_per_device(fn, replicated, examples)
