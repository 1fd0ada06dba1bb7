"""A trainer's full training snapshot, saved and restored with orbax.

Arrays (the `TrainState` leaves, PRNG keys as key data, and the running sums
of a part-done epoch) are packed into one array per dtype and go through
orbax's `PyTreeSave`, restored straight onto the trainer's own strategy and
device count; everything else (counters, the fit's plan, history, the data
loader's position, callbacks' state and metadata, the format version) is
JSON. Orbax writes each step into a temporary folder and renames
it when complete, so an interrupted save is never mistaken for a checkpoint.
"""

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._run import RunPlan
from .._sums import FLAGS, EpochSums
from ._leaf_spec import LeafSpec, check_same_specs, leaf_specs
from ._packing import Layout, pack, packed_sizes, unpack


# Version 2: arrays packed into one array per dtype (_packing.py); 3: a
# part-done epoch's sums as two vectors (sums, flags) and the sums' names.
FORMAT = 3


if TYPE_CHECKING:
    from .._trainer import DataParallelTrainer


def _is_key(leaf: Any) -> bool:
    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _spec(trainer: "DataParallelTrainer") -> list[LeafSpec]:
    """[path, shape, dtype] of every array of the trainer's state."""
    return leaf_specs(trainer.state)[1]


def snapshot(
    trainer: "DataParallelTrainer", data: Any, callbacks: dict
) -> ocp.args.Composite:
    """Everything needed to continue `trainer` exactly, as orbax save args.

    The arrays are copies queued on the devices, not waited for (the next
    step donates the trainer's own buffers); everything else is read now.
    """
    acc = trainer._acc
    leaves = [jax.random.key_data(x) if _is_key(x) else x for x in trainer._leaves]
    packed = pack([*leaves, *(acc or ())], trainer.strategy.replicated)
    host = {
        "format": FORMAT,
        "phalanx": _version(),
        "model": type(trainer.state.model).__name__,
        "strategy": type(trainer.strategy).__name__,
        "devices": trainer.strategy.num_devices,
        "spec": _spec(trainer),
        "step": trainer._step,
        "epoch": trainer._epoch,
        "epoch_steps": trainer._epoch_steps,
        "run": dataclasses.asdict(trainer._run),
        "history": trainer.history.state_dict(),
        "acc": None
        if acc is None
        else {"names": list(trainer._steps.sum_names), "dtype": str(acc.sums.dtype)},
        "data": _data_state(trainer, data),
        "callbacks": callbacks,
    }
    return ocp.args.Composite(
        arrays=ocp.args.PyTreeSave(packed),
        host=ocp.args.JsonSave(host),
    )


def _data_state(trainer: "DataParallelTrainer", data: Any) -> Any:
    """Where `data` stands after the last batch trained on: the pass's note
    of it while batches are read ahead, else the loader's own state."""
    feed = trainer._feed
    if feed is not None and feed.tracking:
        return feed.state
    return data.state_dict() if hasattr(data, "state_dict") else None


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """How a snapshot's items are written: arrays without compression (trained
    float weights barely compress, and zstd would double the CPU time of the
    background writer, which competes with training for the host's cores)."""
    return {
        "arrays": ocp.PyTreeCheckpointHandler(use_compression=False),
        "host": ocp.JsonCheckpointHandler(),
    }


def read_host(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON half of a checkpoint."""
    return manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))[
        "host"
    ]


def check_compatible(trainer: "DataParallelTrainer", host: dict, where: str) -> None:
    """Raise ValueError if phalanx cannot read the checkpoint's format, or
    naming the first leaf where the architectures differ."""
    if host.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint {where} was written by phalanx {host.get('phalanx')} in "
            f"checkpoint format {host.get('format', 1)}; this phalanx "
            f"({_version()}) reads format {FORMAT}: resume it with the phalanx "
            "that wrote it, or start again"
        )
    check_same_specs(
        _spec(trainer),
        host["spec"],
        stored=f"checkpoint {where}",
        kind=f"model or optimizer (model {host['model']})",
        mine=f"this trainer ({type(trainer.state.model).__name__})",
        fix="build the trainer exactly as for the checkpointed run",
    )


def read_arrays(
    trainer: "DataParallelTrainer",
    manager: ocp.CheckpointManager,
    step: int,
    host: dict[str, Any],
) -> list[jax.Array]:
    """The arrays of checkpoint `step` (the state's leaves, then a part-done
    epoch's sums and flags), on the trainer's own strategy's devices."""
    replicated = trainer.strategy.replicated
    layout: Layout = (
        *(
            _layout(jax.random.key_data(x) if _is_key(x) else x)
            for x in trainer._leaves
        ),
        *(
            [
                ((len(host["acc"]["names"]),), host["acc"]["dtype"]),
                ((len(FLAGS),), "int32"),
            ]
            if host["acc"]
            else []
        ),
    )
    like = {
        dtype: jax.ShapeDtypeStruct((size,), np.dtype(dtype), sharding=replicated)
        for dtype, size in packed_sizes(layout).items()
    }
    packed = manager.restore(
        step,
        args=ocp.args.Composite(
            arrays=ocp.args.PyTreeRestore(
                like, restore_args=ocp.checkpoint_utils.construct_restore_args(like)
            )
        ),
    )["arrays"]
    return unpack(packed, layout, replicated)


def apply(
    trainer: "DataParallelTrainer", host: dict[str, Any], leaves: list[jax.Array]
) -> None:
    """Load a checkpoint read by `read_host` and `read_arrays` into `trainer`."""
    current = trainer._leaves
    trainer._leaves = [
        jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
        if _is_key(old)
        else new
        for new, old in zip(leaves[: len(current)], current, strict=True)
    ]
    if host["acc"]:
        trainer._acc = EpochSums(*leaves[len(current) :])
        trainer._steps.sum_names = tuple(host["acc"]["names"])
    else:
        trainer._acc = None
    trainer._step = host["step"]
    trainer._epoch = host["epoch"]
    trainer._epoch_steps = host["epoch_steps"]
    # The run's start is restored; how far it goes is the resuming fit's call.
    saved = RunPlan(**host["run"])
    trainer._run = dataclasses.replace(
        trainer._run, start_step=saved.start_step, start_epoch=saved.start_epoch
    )
    trainer.history.load_state_dict(host["history"])


def _layout(leaf: jax.Array) -> tuple[tuple[int, ...], str]:
    return tuple(leaf.shape), str(leaf.dtype)


def _version() -> str:
    from .. import __version__

    return __version__
