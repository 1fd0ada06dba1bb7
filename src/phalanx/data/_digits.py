"""The UCI handwritten digits, shipped inside the package: read with NumPy,
nothing downloaded."""

import importlib.resources

import numpy as np


Split = tuple[np.ndarray, np.ndarray]


def load_digits() -> tuple[Split, Split]:
    """The 1,797 UCI handwritten digits (8×8 images, 10 classes), split in two.

    A fixed split (the same on every call and machine) of 1,437 training and
    360 test examples, 36 test examples per class. Read from a 47 kB file in
    the package: no download, no network.

    Source: the test-set portion of "Optical Recognition of Handwritten
    Digits", E. Alpaydin & C. Kaynak, UCI Machine Learning Repository (1998),
    licensed CC BY 4.0, as bundled with scikit-learn; see
    ``phalanx/data/DIGITS_LICENSE.txt``.

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: images flattened to shape
        ``(n, 64)``, float32 in [0, 1] (pixel counts 0..16 divided by 16);
        labels int32 in 0..9, shape ``(n,)``.

    Example:
        ```python
        (x_train, y_train), (x_test, y_test) = px.data.load_digits()
        x_train.shape, y_train.dtype  # (1437, 64), int32
        ```
    """
    resource = importlib.resources.files("phalanx.data").joinpath("digits.npz")
    with resource.open("rb") as file, np.load(file) as npz:
        return _split(npz["x_train"], npz["y_train"]), _split(
            npz["x_test"], npz["y_test"]
        )


def _split(images: np.ndarray, labels: np.ndarray) -> Split:
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(16)
    return x, labels.astype(np.int32)
