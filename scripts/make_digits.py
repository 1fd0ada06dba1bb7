"""Make ``src/phalanx/data/digits.npz`` from scikit-learn's copy of UCI digits.

Run once, by hand, when the file must be rebuilt; never at install or test
time (scikit-learn is not a dependency of phalanx)::

    pip install scikit-learn
    python scripts/make_digits.py

The file holds the raw 8×8 images (uint8, 0..16) and labels (uint8) of the
1,797 digits, split once with a fixed seed into 1,437 train / 360 test
examples, stratified: 36 test examples of each class. Source and licence:
``src/phalanx/data/DIGITS_LICENSE.txt``.
"""

import pathlib

import numpy as np
from sklearn.datasets import load_digits


SEED = 0
TEST_PER_CLASS = 36
OUT = pathlib.Path(__file__).resolve().parent.parent / "src/phalanx/data/digits.npz"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    assert images.shape == (1797, 8, 8) and images.max() == 16
    assert np.array_equal(images, digits.images), "pixels must be integers 0..16"

    rng = np.random.default_rng(SEED)
    test = np.concatenate(
        [
            rng.permutation(np.flatnonzero(labels == c))[:TEST_PER_CLASS]
            for c in range(10)
        ]
    )
    train = np.setdiff1d(np.arange(len(labels)), test)
    train, test = rng.permutation(train), rng.permutation(test)
    np.savez_compressed(
        OUT,
        x_train=images[train],
        y_train=labels[train],
        x_test=images[test],
        y_test=labels[test],
    )
    size = OUT.stat().st_size
    print(f"wrote {OUT} ({size} bytes): {len(train)} train, {len(test)} test")


if __name__ == "__main__":
    main()
