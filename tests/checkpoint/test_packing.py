"""How a save copies the state: packed to bytes by NumPy on CPU devices, by
dtype in one compiled call elsewhere (forced here); both restore to the bit,
and checkpoints of format 4 (packed by dtype) still resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import phalanx as px
from helpers import RaiseAt, make_data, make_model, max_abs_diff
from phalanx.checkpoint import _items, _packing
from phalanx.checkpoint._bytes import BYTES, DeviceParts, packed_bytes, unpack_bytes
from phalanx.checkpoint._packing import pack, pack_compiler


def odd_leaves() -> list[jax.Array]:
    """One leaf of each kind of dtype a state may hold, replicated over 8
    devices: random bits (NaNs and all), a 0-d one, bools, a key's data."""
    mesh = jax.make_mesh((8,), ("data",))
    bits = np.random.default_rng(0).integers(0, 2**32, size=64, dtype=np.uint32)
    host = [
        bits[:12].view(np.float32).reshape(3, 4),
        bits[12:13].view(np.float32).reshape(()),
        bits[13:18].view(jnp.bfloat16),
        bits[18:20].view(np.int8),
        bits[20:23] % 2 == 0,
        bits[23:25],
        bits[25:29].view(np.int32).reshape(2, 2),
        bits[29:32].view(np.float16),
    ]
    return [jax.device_put(x, NamedSharding(mesh, P())) for x in host]


def as_bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1).view(np.uint8)


def test_a_pack_is_one_array_of_bytes_and_unpacks_to_the_bit():
    leaves = odd_leaves()
    replicated = leaves[0].sharding
    packed, kept = pack(leaves, [], replicated)
    layout = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
    assert list(packed) == [BYTES] and kept == []
    data = packed[BYTES]
    assert isinstance(data, np.ndarray)  # small, on CPU: by NumPy
    assert data.shape == (packed_bytes(layout),)
    back = unpack_bytes(data, layout, (replicated,) * len(leaves))
    for old, new in zip(leaves, back, strict=True):
        assert new.dtype == old.dtype and new.shape == old.shape
        assert new.sharding == replicated
        np.testing.assert_array_equal(as_bits(new), as_bits(old))


@pytest.mark.parametrize("why", ["accelerator", "large"])
def test_a_pack_on_the_device_is_compiled_ahead_and_reads_the_same_bytes(
    monkeypatch, why
):
    # Not a small state on CPU devices: packed by dtype on the first device
    # (compiled by `pack_compiler`, not waited for), read into the same bytes
    # on the writer thread.
    leaves = odd_leaves()
    replicated = leaves[0].sharding
    on_host = pack(leaves, [], replicated)[0][BYTES]
    assert pack_compiler(leaves, [], replicated) is None  # nothing to compile
    if why == "accelerator":
        monkeypatch.setattr(_packing, "_on_host", lambda sharding: False)
    else:
        monkeypatch.setattr(_packing, "HOST_COPY_BYTES", 16)
    compile_pack = pack_compiler(leaves, [], replicated)
    assert compile_pack is not None
    compile_pack()
    packed, _ = pack(leaves, [], replicated)
    parts = packed[BYTES]
    assert isinstance(parts, DeviceParts)
    kinds = [str(x.dtype) for x in parts.parts]
    assert kinds == list(dict.fromkeys(str(x.dtype) for x in leaves))
    assert all(len(x.sharding.device_set) == 1 for x in parts.parts)
    np.testing.assert_array_equal(parts.read(), on_host)


def run(directory, *, crash=None, resume=None):
    x, y = make_data(100, seed=3)
    loader = px.data.ArrayLoader((x, y), 16, seed=1)  # 7 steps per epoch
    callbacks: list[px.Callback] = [px.callbacks.Checkpoint(directory, every_n_steps=5)]
    if crash is not None:
        callbacks.insert(0, RaiseAt(crash))
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        callbacks=callbacks,
    )
    if crash is None:
        trainer.fit(loader, epochs=2, resume=resume)
    else:
        with pytest.raises(RuntimeError, match=f"boom at step {crash}"):
            trainer.fit(loader, epochs=2, resume=resume)
    return trainer


@pytest.mark.parametrize("written", ["on the host", "on a device", "format 4"])
def test_a_mid_epoch_checkpoint_resumes_to_the_bit(tmp_path, monkeypatch, written):
    # Step 5 is mid-epoch: the epoch's sums are saved with the state.
    with monkeypatch.context() as patch:
        if written == "on a device":
            patch.setattr(_packing, "_on_host", lambda sharding: False)
        if written == "format 4":  # as phalanx wrote before: arrays by dtype
            patch.setattr(_items, "pack", by_dtype)
        run(tmp_path, crash=6)
    metadata = tmp_path / "5" / "host" / "metadata"
    host = json.loads(metadata.read_text())
    assert host.get("packed") == (None if written == "format 4" else "bytes")
    if written == "format 4":
        metadata.write_text(json.dumps({**host, "format": 4}))
    resumed = run(tmp_path, resume="latest")
    straight = run(tmp_path / "straight")
    assert max_abs_diff(resumed.model, straight.model) == 0
    assert resumed.history.epochs == straight.history.epochs


def by_dtype(leaves, others, replicated):
    """Packs as phalanx did before format 5 (and does across processes):
    one array per dtype."""
    kept = tuple(x.sharding for x in others)
    return _packing._packer(replicated, kept)(leaves, others)
