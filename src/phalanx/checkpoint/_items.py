"""A `Snapshot` as orbax checkpoint items, and back.

Arrays (the `TrainState` leaves, PRNG keys as key data, and the running sums
of a part-done epoch) go through orbax's `PyTreeSave`: the replicated ones
packed into one array per dtype, the ones split over devices one by one as
they lie; they are restored straight onto the layout of a `like` snapshot
(the restoring trainer's strategy and device count). Everything else
(progress, history, the data loader's position, callbacks' state and
metadata, the format version, the evaluation sets' positions and the
settings that shape the run's updates) is JSON. Orbax writes each step into a
temporary folder and renames it when complete, so an interrupted save is
never mistaken for a checkpoint.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from .._state._history import History
from .._state._progress import RunProgress
from .._state._snapshot import Snapshot
from .._state._sums import FLAGS, EpochSums
from .._version import __version__
from ..strategies._placement import named
from ._bytes import BYTES, DeviceParts, packed_bytes, unpack_bytes
from ._leaf_spec import LeafSpec, array_specs, check_same_specs
from ._packing import Layout, pack, pack_compiler, packed_sizes, unpack
from ._settings import check_same_settings


# Version 2: arrays packed into one array per dtype (_packing.py); 3: a
# part-done epoch's sums as two vectors (sums, flags) and the sums' names;
# 4: the state's rate multiplier (`TrainState.lr_scale`) among its arrays;
# 5: on CPU devices, the replicated arrays as one array of their bytes
# ("packed": "bytes"; else one per dtype, as in 4, which is still read);
# 6: a part-done pass's rows ("pass_rows") are every process's, not one's
# (a resume may be on another number of processes), and "processes" says
# how many saved it.
# (Arrays split over devices are saved beside the packed ones, as "leaf_<i>",
# and listed in "split"; a checkpoint without any reads as before.)
FORMAT = 6
READS = (4, 5, 6)  # the formats this phalanx reads


def _is_key(leaf: Any) -> bool:
    return _is_key_dtype(leaf.dtype)


@functools.cache
def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _state_leaves(snapshot: Snapshot) -> list[jax.Array]:
    return array_specs(snapshot.state)[0]


def _spec(snapshot: Snapshot) -> list[LeafSpec]:
    """[path, shape, dtype] of every array of the snapshot's state."""
    return array_specs(snapshot.state)[1]


def _arrays(snapshot: Snapshot) -> tuple[list[jax.Array], list[LeafSpec]]:
    """The state's arrays (keys as key data), then the epoch's sums; and the
    state's spec."""
    leaves, spec = array_specs(snapshot.state)
    arrays = [jax.random.key_data(x) if _is_key(x) else x for x in leaves]
    return [*arrays, *(snapshot.progress.sums or ())], spec


def _replicated(leaves: list[jax.Array]) -> NamedSharding:
    """Where packed arrays live: replicated over the state's mesh."""
    sharding = leaves[0].sharding
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"checkpoints need the state's arrays on a mesh (NamedSharding); the "
            f"strategy placed them with {type(sharding).__name__}: return "
            "NamedShardings from Strategy.state_shardings"
        )
    return named(sharding.mesh, P())


def _packing_args(
    arrays: list[jax.Array],
) -> tuple[list[int], list[jax.Array], list[jax.Array], NamedSharding]:
    """Which of `arrays` are split over devices (saved one by one), the
    others (packed), the split ones, and where packed arrays live."""
    split = [i for i, x in enumerate(arrays) if not x.sharding.is_fully_replicated]
    return (
        split,
        [x for i, x in enumerate(arrays) if i not in split],
        [arrays[i] for i in split],
        _replicated(arrays),
    )


def save_compiler(snapshot: Snapshot) -> Callable[[], None] | None:
    """A function compiling what `save_items` runs on the devices for
    snapshots shaped as `snapshot` (see `pack_compiler`)."""
    return pack_compiler(*_packing_args(_arrays(snapshot)[0])[1:])


class SaveItems(NamedTuple):
    """A snapshot as it is saved: `arrays` (copies: on the devices, queued
    and not waited for, or on the host) and `host` (plain data)."""

    arrays: dict[str, Any]
    host: dict[str, Any]

    @property
    def on_host(self) -> bool:
        """Whether the arrays were copied to the host (a small state on CPU
        devices: `HOST_COPY_BYTES` at most)."""
        return isinstance(self.arrays.get(BYTES), np.ndarray)

    def orbax_args(self) -> ocp.args.Composite:
        """These items as orbax save args, made on the writer thread: arrays
        packed on a device are read into bytes there, and orbax checks what
        it is given (~40 us of Python)."""
        arrays = {
            k: v.read() if isinstance(v, DeviceParts) else v
            for k, v in self.arrays.items()
        }
        return ocp.args.Composite(
            arrays=ocp.args.PyTreeSave(arrays),
            host=ocp.args.JsonSave(self.host),
        )


def save_items(snapshot: Snapshot) -> SaveItems:
    """What a save of `snapshot` writes, taken now.

    The arrays are copies (the next step donates the run's own buffers);
    everything else is read now.
    """
    arrays, spec = _arrays(snapshot)
    split, leaves, others, replicated = _packing_args(arrays)
    packed, kept = pack(leaves, others, replicated)
    tree = {**packed, **{f"leaf_{i}": x for i, x in zip(split, kept, strict=True)}}
    host = {
        "format": FORMAT,
        "phalanx": __version__,
        "model": type(snapshot.state.model).__name__,
        "strategy": snapshot.strategy,
        "devices": snapshot.devices,
        "processes": jax.process_count(),
        "spec": spec,
        **snapshot.progress.state_dict(),
        "history": snapshot.history,
        "data": snapshot.data,
        "eval_data": snapshot.eval_data,
        "settings": snapshot.settings,
        "callbacks": snapshot.callbacks,
    }
    if split:
        host["split"] = split
    if BYTES in packed:
        host["packed"] = BYTES
    return SaveItems(tree, host)


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """How a snapshot's items are written: arrays without compression (trained
    float weights barely compress, and zstd would double the CPU time of the
    background writer, which competes with training for the host's cores)."""
    return {
        "arrays": ocp.PyTreeCheckpointHandler(use_compression=False),
        "host": ocp.JsonCheckpointHandler(),
    }


def read_host(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON half of a checkpoint, checked where its format is one this
    phalanx reads (`check_host`; another format is refused by
    `check_compatible`).

    Raises:
        ValueError: the record is not one a save writes (`check_host`).
    """
    host = manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))[
        "host"
    ]
    if not isinstance(host, dict):
        raise ValueError(f"its host record is a {type(host).__name__}, not a dict")
    if host.get("format") in READS:
        check_host(host)
    return host


# The entries every host record of the formats read holds (eval_data and
# settings are absent from those written before they were kept), and the
# types of some (the progress's and history's are checked by their classes,
# the data's position by its loader).
_HOST_ENTRIES = ("model", "spec", "strategy", "devices", "history", "data", "callbacks")
_HOST_TYPES = {"spec": list, "callbacks": dict, "eval_data": dict, "settings": dict}


def check_host(host: dict[str, Any]) -> None:
    """Raise ValueError, in one line, where a host record holds what no save
    writes: a negative step, a step that is not an int, a malformed history
    or plan. Edited or damaged, the checkpoint is then one a resume cannot
    honour, refused before its arrays are read or anything is restored (the
    data's position is the loader's to check: `restore_run`)."""
    missing = [name for name in _HOST_ENTRIES if name not in host]
    if missing:
        raise ValueError(f"its host record has no {missing[0]!r}")
    for name, kind in _HOST_TYPES.items():
        value = host.get(name, kind())
        if not isinstance(value, kind):
            raise ValueError(
                f"its host record's {name}={value!r:.60} must be a {kind.__name__}"
            )
    try:
        RunProgress.from_state_dict(host, None)
        History().load_state_dict(host["history"])
    except ValueError as error:
        problem = str(error)
    else:
        return
    # (Raised here, not in the except: the reason a failed read gives is the
    # innermost error's, `summary`.)
    raise ValueError(f"its host record's {problem}")


def check_compatible(like: Snapshot, host: dict, where: str) -> None:
    """Raise ValueError if phalanx cannot read the checkpoint's format,
    naming the first setting that shapes updates where the trainer differs
    from the checkpointed run (`check_same_settings`), or the first leaf
    where the architectures differ."""
    if host.get("format") not in READS:
        raise ValueError(
            f"checkpoint {where} was written by phalanx {host.get('phalanx')} in "
            f"checkpoint format {host.get('format', 1)}; this phalanx "
            f"({__version__}) reads formats {READS[0]} to {FORMAT}: resume it with "
            "the phalanx that wrote it, or start again"
        )
    # (Absent from checkpoints written before settings were kept.)
    check_same_settings(like.settings, host.get("settings", {}), f"checkpoint {where}")
    check_same_specs(
        _spec(like),
        host["spec"],
        stored=f"checkpoint {where}",
        kind=f"model or optimizer (model {host['model']})",
        mine=f"this trainer ({type(like.state.model).__name__})",
        fix="build the trainer exactly as for the checkpointed run",
    )


def read_arrays(
    like: Snapshot, manager: ocp.CheckpointManager, step: int, host: dict[str, Any]
) -> list[jax.Array]:
    """The arrays of checkpoint `step` (the state's, then a part-done epoch's
    sums and flags), laid out as `like`'s state is."""
    mine = [jax.random.key_data(x) if _is_key(x) else x for x in _state_leaves(like)]
    replicated = _replicated(mine)
    shapes: Layout = tuple(_layout(x) for x in mine)
    shardings = [x.sharding for x in mine]
    if host["acc"]:
        acc = host["acc"]  # "size": since metrics have statistics
        shapes += (((acc.get("size", len(acc["names"])),), acc["dtype"]),)
        shapes += (((len(FLAGS),), "int32"),)
        shardings += [replicated, replicated]
    split = set(host.get("split", ()))
    packed_layout = tuple(s for i, s in enumerate(shapes) if i not in split)
    packed_shardings = tuple(s for i, s in enumerate(shardings) if i not in split)
    in_bytes = host.get("packed") == BYTES
    like_tree: dict[str, Any] = {
        f"leaf_{i}": jax.ShapeDtypeStruct(
            shapes[i][0], np.dtype(shapes[i][1]), sharding=shardings[i]
        )
        for i in sorted(split)
    }
    if not in_bytes:
        like_tree |= {
            dtype: jax.ShapeDtypeStruct((size,), np.dtype(dtype), sharding=replicated)
            for dtype, size in packed_sizes(packed_layout).items()
        }
    restore_args = ocp.checkpoint_utils.construct_restore_args(like_tree)
    if in_bytes and packed_layout:  # read onto the host, then laid out
        like_tree[BYTES] = np.zeros((0,), np.uint8)
        restore_args[BYTES] = ocp.RestoreArgs(restore_type=np.ndarray)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            arrays=ocp.args.PyTreeRestore(like_tree, restore_args=restore_args)
        ),
    )["arrays"]
    if in_bytes:
        size = packed_bytes(packed_layout)
        if packed_layout and restored[BYTES].shape != (size,):
            raise ValueError(
                f"holds {restored[BYTES].shape[0]} bytes of packed arrays where "
                f"its spec says {size}"
            )
        leaves = (
            unpack_bytes(restored[BYTES], packed_layout, packed_shardings)
            if packed_layout
            else []
        )
    else:
        packed = {k: v for k, v in restored.items() if not k.startswith("leaf_")}
        leaves = unpack(packed, packed_layout, packed_shardings)
    unpacked = iter(leaves)
    return [
        restored[f"leaf_{i}"] if i in split else next(unpacked)
        for i in range(len(shapes))
    ]


def from_checkpoint(
    like: Snapshot, host: dict[str, Any], arrays: list[jax.Array]
) -> Snapshot:
    """The snapshot a checkpoint holds, read by `read_host` and `read_arrays`."""
    mine = _state_leaves(like)
    leaves = [
        jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
        if _is_key(old)
        else new
        for new, old in zip(arrays[: len(mine)], mine, strict=True)
    ]
    dynamic, static = eqx.partition(like.state, eqx.is_array)
    state = eqx.combine(jax.tree.unflatten(jax.tree.structure(dynamic), leaves), static)
    sums = EpochSums(*arrays[len(mine) :]) if host["acc"] else None
    if host["format"] < 6 and host.get("pass_rows") is not None:
        # One process's rows then; read as this run's layout's, as they were.
        host = {**host, "pass_rows": host["pass_rows"] * jax.process_count()}
    return dataclasses.replace(
        like,
        state=state,
        progress=RunProgress.from_state_dict(host, sums),
        history=host["history"],
        data=host["data"],
        eval_data=host.get("eval_data", {}),
        settings=host.get("settings", {}),
        callbacks=host["callbacks"],
        strategy=host["strategy"],
        devices=host["devices"],
    )


def _layout(leaf: jax.Array) -> tuple[tuple[int, ...], str]:
    return tuple(leaf.shape), str(leaf.dtype)
