"""Write a dataset larger than memory, then train on it from disk.

The bundled digits, upsampled to 32 × 32 and augmented (a random shift of
up to 3 pixels and noise, a new draw for every copy), written as ArrayRecord
splits with `px.data.write_records` one chunk at a time: ``--gib 1`` is
262,144 training examples of 4 KiB. Then::

    phalanx train --dataset records:OUT --data-workers 2 --hidden 256

reads them from disk as it trains (through `px.data.GrainLoader`): its
resident memory stays far below the dataset's size, and ``--resume``
continues exactly, reading nothing twice.

Run: ``python examples/digits_on_disk.py OUT [--gib 1] [--test 4096]``
"""

import argparse
import pathlib

import numpy as np

import phalanx as px


SIDE = 32  # 8 × 8 digits upsampled 4 ×: 1,024 float32 features, 4 KiB
CHUNK = 8192  # examples made and written at a time


def augmented(digits: np.ndarray, labels: np.ndarray, count: int, seed: int):
    """`count` augmented copies of the digits, as ``(x, y)`` chunks."""
    rng = np.random.default_rng(seed)
    large = np.kron(digits.reshape(-1, 8, 8), np.ones((4, 4), np.float32))
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        picks = rng.integers(0, len(large), n)
        shifts = rng.integers(-3, 4, (n, 2))
        images = np.stack(
            [
                np.roll(large[p], tuple(s), axis=(0, 1))
                for p, s in zip(picks, shifts, strict=True)
            ]
        )
        images += rng.normal(0, 0.1, images.shape).astype(np.float32)
        yield images.reshape(n, -1).astype(np.float32), labels[picks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--gib", type=float, default=1.0, help="training split size")
    parser.add_argument("--test", type=int, default=4096, help="test examples")
    args = parser.parse_args()
    (x, y), _ = px.data.load_digits()
    x = (x - x.mean()) / x.std()
    train = int(args.gib * 2**30) // (SIDE * SIDE * 4)
    for split, count, seed in (("train", train, 0), ("test", args.test, 1)):
        chunks = augmented(x, y, count, seed)  # a rerun replaces the splits
        records = px.data.write_records(args.out, split, chunks, overwrite=True)
        size = records.path.stat().st_size / 2**30
        print(f"{split}: {len(records)} examples, {size:.2f} GiB in {records.path}")


if __name__ == "__main__":
    main()
