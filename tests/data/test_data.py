"""phalanx.data: the array loader (coverage, order, resume, exact padding), other
iterables the trainer takes as they are, and the digits and MNIST loaders."""

import gc
import gzip
import hashlib
from collections.abc import Iterator

import jax
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import STRATEGIES, make_data, make_model, max_abs_diff, reference_fit
from phalanx.data import ArrayLoader, load_digits, load_mnist
from phalanx.data._buffers import BufferPool


def ids_loader(n: int, batch_size: int, **kwargs) -> ArrayLoader:
    """A loader over (ids, ids²): each row says which example it is."""
    ids = np.arange(n, dtype=np.int64)
    return ArrayLoader((ids, ids**2), batch_size, **kwargs)


def tuples(loader: ArrayLoader) -> Iterator[tuple[np.ndarray, ...]]:
    """The batches of a loader given a tuple of arrays (so tuples too)."""
    for batch in loader:
        assert isinstance(batch, tuple)
        yield batch


def epoch_of(loader: ArrayLoader) -> list[tuple[np.ndarray, ...]]:
    return [tuple(part.copy() for part in batch) for batch in tuples(loader)]


def global_batches(n: int, batch_size: int, processes: int, epochs: int, **kwargs):
    """Per epoch, the global batches: every process's slice, concatenated."""
    loaders = [
        ids_loader(n, batch_size, process_index=i, process_count=processes, **kwargs)
        for i in range(processes)
    ]
    for _ in range(epochs):
        slices = [epoch_of(loader) for loader in loaders]
        yield [
            tuple(np.concatenate(parts) for parts in zip(*per_process, strict=True))
            for per_process in zip(*slices, strict=True)
        ]


# ------------------------------------------------------------ ArrayLoader


@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize(("n", "batch_size"), [(100, 16), (100, 64), (96, 32)])
def test_every_example_once_per_epoch_across_processes(processes, n, batch_size):
    for batches in global_batches(n, batch_size, processes, epochs=3):
        assert len(batches) == -(-n // batch_size)
        for ids, squares, weight in batches:
            assert ids.shape == squares.shape == weight.shape == (batch_size,)
            assert weight.dtype == np.float32
            np.testing.assert_array_equal(squares, ids**2)
            real = weight == 1
            assert set(np.unique(weight)) <= {0.0, 1.0}
            # Padding is zeros with weight 0, and only at the end.
            assert not ids[~real].any() and real.tolist() == sorted(real, reverse=True)
        real_ids = np.concatenate([ids[w == 1] for ids, _, w in batches])
        assert sorted(real_ids.tolist()) == list(range(n))


def test_drop_last_drops_the_short_batch():
    for batches in global_batches(100, 32, 2, epochs=2, drop_last=True):
        assert len(batches) == 3
        ids = np.concatenate([b[0] for b in batches])
        assert all((b[2] == 1).all() for b in batches)
        assert len(set(ids.tolist())) == 96


def test_len_is_batches_per_epoch():
    assert len(ids_loader(100, 64)) == 2
    assert len(ids_loader(100, 64, drop_last=True)) == 1
    assert len(ids_loader(128, 64)) == 2
    assert len(ids_loader(100, 8, process_index=0, process_count=4)) == 13


def test_order_is_reproducible_and_new_each_epoch():
    def order(**kwargs) -> list[list[int]]:
        loader = ids_loader(50, 10, **kwargs)
        return [
            np.concatenate([b[0] for b in tuples(loader)]).tolist() for _ in range(3)
        ]

    first = order(seed=3)
    assert order(seed=3) == first
    assert all(sorted(epoch) == list(range(50)) for epoch in first)
    assert first[0] != first[1] != first[2] != first[0]
    assert order(seed=4)[0] != first[0]
    assert order(shuffle=False) == [list(range(50))] * 3
    expected = np.random.default_rng([3, 1]).permutation(50).tolist()
    assert first[1] == expected


def test_iteration_continues_where_it_stopped():
    reference = epoch_of(ids_loader(40, 8))
    loader = ids_loader(40, 8)
    seen = []
    for batch in tuples(loader):
        seen.append(batch[0].copy())
        if len(seen) == 2:
            break
    assert loader.state_dict() == {"epoch": 0, "position": 2, "batch_size": 8}
    seen += [batch[0] for batch in tuples(loader)]
    assert loader.state_dict() == {"epoch": 1, "position": 0, "batch_size": 8}
    assert [s.tolist() for s in seen] == [r[0].tolist() for r in reference]


@pytest.mark.parametrize("stop_after", [7, 5, 10])  # mid-epoch, boundary, later
def test_state_dict_resumes_exactly(stop_after):
    def stream(loader: ArrayLoader, count: int) -> list[list[int]]:
        out = []
        while len(out) < count:
            for batch in tuples(loader):
                out.append(batch[0].tolist())
                if len(out) == count:
                    break
        return out

    full = stream(ids_loader(40, 8, seed=1), 15)  # 5 batches per epoch
    first = ids_loader(40, 8, seed=1)
    head = stream(first, stop_after)
    state = first.state_dict()
    assert state == {
        "epoch": stop_after // 5,
        "position": stop_after % 5,
        "batch_size": 8,
    }
    resumed = ids_loader(40, 8, seed=1)
    resumed.load_state_dict(state)
    assert head + stream(resumed, 15 - stop_after) == full


@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_are_aligned_for_use_in_place(shuffle):
    # 64-byte aligned host arrays become CPU device arrays without a copy.
    x, y = make_data(50)
    batches = list(tuples(ArrayLoader((x, y), 16, shuffle=shuffle, seed=0)))
    for batch in batches:
        assert all(leaf.ctypes.data % 64 == 0 for leaf in batch)
        assert all(leaf.flags.c_contiguous for leaf in batch)
    placed = jax.device_put(batches[0][0], jax.devices()[0])
    assert placed.unsafe_buffer_pointer() == batches[0][0].ctypes.data
    last = batches[-1]  # 2 real examples, padded with zeros of weight 0
    np.testing.assert_array_equal(last[2], [1, 1] + [0] * 14)
    assert not last[0][2:].any() and not last[1][2:].any()
    order = np.arange(48, 50) if not shuffle else None
    if order is not None:
        np.testing.assert_array_equal(last[0][:2], x[order])


def test_buffers_are_reused_only_when_nothing_views_them():
    pool = BufferPool(limit=3)
    f32 = np.dtype(np.float32)
    a = pool.empty((4, 8), f32)
    a_data = a.ctypes.data
    b = pool.empty((4, 8), f32)
    assert b.ctypes.data != a_data  # a still held
    tail = a[2:]
    del a
    assert pool.empty((4, 8), f32).ctypes.data not in (a_data, b.ctypes.data)
    del tail  # the last view of a's buffer
    assert pool.empty((4, 8), f32).ctypes.data == a_data


def test_a_batch_on_a_cpu_device_keeps_its_buffer():
    # JAX uses an aligned array in place: its buffer must wait for the device
    # array too.
    pool = BufferPool()
    f32 = np.dtype(np.float32)
    host = pool.empty((16, 16), f32)
    host[:] = 7.0
    address = host.ctypes.data
    placed = jax.device_put(host, jax.devices()[0])
    assert placed.unsafe_buffer_pointer() == address  # no copy
    del host
    other = pool.empty((16, 16), f32)
    other[:] = 0.0
    assert other.ctypes.data != address
    np.testing.assert_array_equal(np.asarray(placed), 7.0)
    del placed
    gc.collect()  # a jax.Array that has been read is freed by the collector
    assert pool.empty((16, 16), f32).ctypes.data == address


def test_beyond_the_limit_batches_get_fresh_memory():
    pool = BufferPool(limit=2)
    f32 = np.dtype(np.float32)
    held = [pool.empty((8,), f32) for _ in range(4)]
    addresses = [x.ctypes.data for x in held]
    del held
    again = [pool.empty((8,), f32) for _ in range(2)]
    assert {x.ctypes.data for x in again} == set(addresses[:2])


def test_dict_arrays_yield_dicts_with_sample_weight():
    x, y = make_data(10)
    loader = ArrayLoader({"x": x, "y": y}, 4, shuffle=False)
    batches = [b for b in loader if isinstance(b, dict)]  # all of them, 3
    assert [list(b) for b in batches] == [["x", "y", "sample_weight"]] * 3
    np.testing.assert_array_equal(batches[0]["x"], x[:4])
    np.testing.assert_array_equal(batches[2]["sample_weight"], [1, 1, 0, 0])
    np.testing.assert_array_equal(batches[2]["y"], [*y[8:], 0, 0])


def test_process_defaults_come_from_jax():
    loader = ids_loader(10, 4)
    assert (loader.process_index, loader.process_count) == (0, 1)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_padded_batches_train_exactly_like_unpadded(name):
    # 100 examples in global batches of 64: the second holds 36 real examples
    # and 28 zero-weight ones; two epochs, each a different permutation.
    x, y = make_data(100, seed=1)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=STRATEGIES[name]()
    )
    trainer.fit(ArrayLoader((x, y), 64, seed=2), epochs=2)
    twin = ArrayLoader((x, y), 64, seed=2)
    unpadded = [(bx[w == 1], by[w == 1]) for _ in range(2) for bx, by, w in twin]
    assert [len(b[0]) for b in unpadded] == [64, 36, 64, 36]
    reference = reference_fit(make_model(), unpadded, steps=4)
    assert max_abs_diff(trainer.model, reference) <= 1e-5
    assert trainer.history[-1]["loss"] > 0


def test_unshuffled_loader_matches_reference_on_the_plain_split():
    x, y = make_data(100)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(ArrayLoader((x, y), 64, shuffle=False), steps=3)
    batches = [(x[:64], y[:64]), (x[64:], y[64:])]
    assert max_abs_diff(trainer.model, reference_fit(make_model(), batches, 3)) <= 1e-5


def test_dict_loader_trains_with_overridden_hooks():
    class DictTrainer(px.DataParallelTrainer):
        def split_batch(self, batch):
            return batch["x"], batch["y"]

        def sample_weight(self, batch):
            return batch["sample_weight"]

    x, y = make_data(100)
    trainer = DictTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(ArrayLoader({"x": x, "y": y}, 64, shuffle=False), steps=3)
    batches = [(x[:64], y[:64]), (x[64:], y[64:])]
    assert max_abs_diff(trainer.model, reference_fit(make_model(), batches, 3)) <= 1e-5


# --------------------------------------------- other iterables, as they are


class Regenerating:
    """Makes a generator re-iterable: a new one for every pass."""

    def __init__(self, generator_fn):
        self.generator_fn = generator_fn

    def __iter__(self):
        return self.generator_fn()


class FakeTensor:
    """Stands in for a torch.Tensor: NumPy-convertible, sized, nothing more."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)

    def __len__(self) -> int:
        return len(self._array)


class FakeTorchLoader:
    """Yields ``[x, y]`` lists of tensor-likes, like a torch DataLoader."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __iter__(self):
        for i in range(0, len(self.x), self.batch_size):
            s = slice(i, i + self.batch_size)
            yield [FakeTensor(self.x[s]), FakeTensor(self.y[s])]


def test_generator_batches_train():
    x, y = make_data(100, seed=3)

    def batches():
        for i in range(0, 100, 32):
            yield x[i : i + 32], y[i : i + 32]

    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(Regenerating(batches), epochs=2)
    reference = reference_fit(make_model(), list(batches()), steps=8)
    assert int(trainer.state.step) == 8
    assert max_abs_diff(trainer.model, reference) <= 1e-5


def test_torch_style_loader_trains():
    x, y = make_data(100, seed=4)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(FakeTorchLoader(x, y, 32), epochs=2)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)]
    reference = reference_fit(make_model(), batches, steps=8)
    assert max_abs_diff(trainer.model, reference) <= 1e-5
    assert len(trainer.history) == 2


def test_string_leaf_is_a_clear_error():
    x, y = make_data(8)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(TypeError, match=r"batch 0 of epoch 0 leaf batch\[1\].*<U"):
        trainer.fit([(x, np.array(["cat"] * 8))])


def test_leaves_disagreeing_on_examples_is_a_clear_error():
    x, y = make_data(8)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"disagree on the leading.*8.*7"):
        trainer.fit([(x, y[:7])])


# ---------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size=0 must be at least 1"),
        ({"batch_size": 2.5}, TypeError, r"batch_size=2.5 must be an int"),
        ({"batch_size": True}, TypeError, r"batch_size=True must be an int"),
        ({"seed": -1}, ValueError, r"seed=-1"),
        ({"shuffle": "yes"}, TypeError, r"shuffle='yes' must be True or False"),
        (
            {"batch_size": 10, "process_index": 0, "process_count": 4},
            ValueError,
            r"batch_size=10 is not divisible by process_count=4.*8 or 12",
        ),
        (
            {"process_index": 2, "process_count": 2},
            ValueError,
            r"process_index=2 is out of range for process_count=2.*\[0, 1\]",
        ),
        ({"process_index": -1, "process_count": 2}, ValueError, r"process_index=-1"),
        ({"process_index": 0, "process_count": 0}, ValueError, r"process_count=0"),
        (
            {"batch_size": 20, "drop_last": True},
            ValueError,
            r"drop_last=True.*batch_size=20 > 10 examples",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"batch_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        ids_loader(10, **kwargs)


@pytest.mark.parametrize(
    ("arrays", "error", "match"),
    [
        ((np.zeros(5), np.zeros(4)), ValueError, r"arrays\[0\]': 5.*arrays\[1\]': 4"),
        ({"x": np.zeros(5), "y": np.zeros(3)}, ValueError, r"\"arrays\['y'\]\": 3"),
        (np.zeros(5), TypeError, r"arrays is a ndarray; pass a tuple"),
        ((), ValueError, r"arrays=\(\) is empty"),
        (([1, 2, 3],), TypeError, r"arrays\[0\] is a list.*np.asarray"),
        ((np.zeros(()),), TypeError, r"leading examples axis"),
        ((np.array(["a", "b"]),), TypeError, r"arrays\[0\] is a <U1.*numeric"),
        ((np.zeros((0, 3)),), ValueError, r"0 examples"),
        ({"sample_weight": np.ones(3)}, ValueError, r"already has a 'sample_weight'"),
        ({1: np.ones(3)}, TypeError, r"non-string keys \[1\]"),
    ],
)
def test_bad_arrays(arrays, error, match):
    with pytest.raises(error, match=match):
        ArrayLoader(arrays, 2)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ({"epoch": 0}, ValueError, r"keys 'epoch', 'position' and 'batch_size'"),
        ([0, 1], ValueError, r"state_dict=\[0, 1\] must be a dict"),
        ({"epoch": -1, "position": 0}, ValueError, r"state_dict\['epoch'\]=-1"),
        ({"epoch": 0, "position": 1.0}, TypeError, r"\['position'\]=1.0 must be an"),
        ({"epoch": 0, "position": 3}, ValueError, r"position'\]=3 is past the 3"),
    ],
)
def test_bad_state_dict(state, error, match):
    loader = ids_loader(10, 4)
    with pytest.raises(error, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict() == {"epoch": 0, "position": 0, "batch_size": 4}


# ----------------------------------------------------------------- digits


def test_load_digits():
    (x_train, y_train), (x_test, y_test) = load_digits()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == x_test.dtype == np.float32
    assert y_train.dtype == y_test.dtype == np.int32
    for x in (x_train, x_test):
        assert x.min() == 0.0 and x.max() == 1.0
        np.testing.assert_array_equal(x * 16, np.round(x * 16))  # counts 0..16
    assert np.bincount(y_test).tolist() == [36] * 10
    assert np.bincount(y_train, minlength=10).min() > 130


def test_digits_split_is_fixed():
    (x_train, y_train), (x_test, y_test) = load_digits()
    (x_again, _), _ = load_digits()
    np.testing.assert_array_equal(x_train, x_again)
    digest = hashlib.sha256()
    for array in (x_train, y_train, x_test, y_test):
        digest.update(array.tobytes())
    assert digest.hexdigest()[:16] == DIGITS_SHA256_PREFIX


DIGITS_SHA256_PREFIX = "588bbcddae738413"


# ------------------------------------------------------------------ MNIST


MNIST_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim])
    sizes = b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    return header + sizes + array.astype(np.uint8).tobytes()


def write(path, data: bytes, gz: bool) -> None:
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


@pytest.fixture
def fake_mnist(tmp_path):
    """20 train and 10 test fake 28×28 images; train gzipped, test raw."""
    rng = np.random.default_rng(0)
    data = {}
    for split, n in (("train", 20), ("test", 10)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for name, array in zip(MNIST_NAMES[split], (images, labels), strict=True):
            write(tmp_path / name, idx_bytes(array), gz=split == "train")
        data[split] = images, labels
    return tmp_path, data


def test_load_mnist_raw_and_gzipped(fake_mnist):
    folder, data = fake_mnist
    (x_train, y_train), (x_test, y_test) = load_mnist(folder)
    assert x_train.shape == (20, 784) and x_test.shape == (10, 784)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    for (x, y), split in (((x_train, y_train), "train"), ((x_test, y_test), "test")):
        images, labels = data[split]
        np.testing.assert_allclose(x, images.reshape(-1, 784) / 255, atol=1e-7)
        np.testing.assert_array_equal(y, labels)
    assert 0 <= x_train.min() and x_train.max() <= 1
    # A str path works as well as a Path.
    np.testing.assert_array_equal(load_mnist(str(folder))[1][1], y_test)


def test_load_mnist_missing(fake_mnist, tmp_path):
    folder, _ = fake_mnist
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte \(or"):
        load_mnist(folder)
    with pytest.raises(FileNotFoundError, match=r"is not a folder"):
        load_mnist(tmp_path / "nowhere")


def corrupt_labels(folder, data: bytes, gz: bool = False) -> None:
    for suffix in ("", ".gz"):
        (folder / ("t10k-labels-idx1-ubyte" + suffix)).unlink(missing_ok=True)
    write(folder / "t10k-labels-idx1-ubyte", data, gz)


@pytest.mark.parametrize(
    ("make", "gz", "match"),
    [
        (
            lambda good: b"\x00\x00\x08\x03" + good[4:],
            False,
            r"magic number 0x00000801",
        ),
        (lambda good: good[:2], False, r"magic number.*found 2 bytes"),
        (lambda good: good[:-1], False, r"is truncated: .*shape \(10,\)"),
        (lambda good: good[:-1], True, r"is truncated"),
        (lambda good: good + b"\x00", False, r"longer than its header says"),
        (lambda good: good[:8] + good[9:], False, r"is truncated"),
    ],
)
def test_load_mnist_corrupt_file(fake_mnist, make, gz, match):
    folder, data = fake_mnist
    corrupt_labels(folder, make(idx_bytes(data["test"][1])), gz)
    with pytest.raises(ValueError, match=match) as info:
        load_mnist(folder)
    assert "t10k-labels-idx1-ubyte" in str(info.value)
    assert "IDX file" in str(info.value)


def test_load_mnist_corrupt_gzip(fake_mnist):
    folder, data = fake_mnist
    good = gzip.compress(idx_bytes(data["test"][1]))
    for broken in (b"not gzip at all", good[: len(good) // 2]):
        corrupt_labels(folder, broken)
        (folder / "t10k-labels-idx1-ubyte").rename(folder / "t10k-labels-idx1-ubyte.gz")
        with pytest.raises(ValueError, match=r"labels-idx1-ubyte.gz could not be"):
            load_mnist(folder)


def test_load_mnist_count_mismatch(fake_mnist):
    folder, data = fake_mnist
    corrupt_labels(folder, idx_bytes(data["test"][1][:9]))
    with pytest.raises(ValueError, match=r"holds 10 images but .* holds 9 labels"):
        load_mnist(folder)
