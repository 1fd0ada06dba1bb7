"""Inference weights in one file: `save_model` / `load_model`.

The file is an ``.npz`` archive (NumPy's own format: no pickle, nothing is
executed on load) holding every array leaf of the model and a JSON spec of
their paths, shapes and dtypes, so loading into a model of another
architecture names the first leaf that differs. It is written to a temporary
file and renamed into place, so a crash never leaves a half-written model.
"""

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import TypeVar

import equinox as eqx
import jax
import numpy as np

from .._typing import validates_own_arguments
from ..strategies._placement import to_host
from ._leaf_spec import check_same_specs, leaf_specs


_Model = TypeVar("_Model")
_FORMAT = "phalanx-model-2"  # 2: leaves as [path, shape, dtype] lists


@validates_own_arguments
def save_model(path: str | os.PathLike[str], model: eqx.Module) -> None:
    """Save a model's arrays (no optimizer state) for inference.

    Args:
        path: the file to write (conventionally ``*.npz``); its folder is
            created if needed. An existing file is replaced atomically. In a
            multi-process run only process 0 writes it.
        model: any Equinox model (a pytree holding arrays), e.g.
            ``trainer.model``.

    Raises:
        TypeError: `model` holds no arrays (e.g. the trainer itself was
            passed), or a leaf cannot be stored (e.g. a PRNG key array).

    Example:
        ```python
        px.save_model("mlp.npz", trainer.model)
        model = px.load_model("mlp.npz", like=px.models.MLP(64, 10, key=key))
        ```
    """
    path = Path(path)
    leaves, spec = leaf_specs(model)
    if not leaves:
        name = type(model).__name__
        raise TypeError(
            f"model={name if hasattr(model, 'fit') else repr(model)[:80]} holds no "
            "arrays, so there are no weights to save; pass the model itself, e.g. "
            "px.save_model(path, trainer.model)"
        )
    arrays = {}
    for index, (leaf, entry) in enumerate(zip(leaves, spec, strict=True)):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"model{entry[0]} is a PRNG key array, which save_model does "
                "not store; keep keys out of the model or save them separately"
            )
        arrays[f"leaf_{index}"] = to_host(leaf)
    if jax.process_index() != 0:
        return  # in a multi-process run the file is written once, by process 0
    header = json.dumps(
        {"format": _FORMAT, "model": type(model).__name__, "leaves": spec}
    )
    arrays["spec"] = np.frombuffer(header.encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            np.savez(file, **arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


@validates_own_arguments
def load_model(path: str | os.PathLike[str], *, like: _Model) -> _Model:
    """Load weights saved by `save_model` into a model shaped like `like`.

    Args:
        path: a file written by `save_model`.
        like: a model of the same architecture (its values are replaced).

    Returns:
        `like` with the saved arrays.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is corrupt or truncated, or holds another
            architecture (the message names the first differing leaf and
            both shapes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"path={str(path)!r} does not exist; pass a file written by px.save_model"
        )
    try:
        # Our own file handle: np.load leaks its own when the zip is corrupt.
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as archive:
            header = json.loads(archive["spec"].tobytes().decode())
            if header.get("format") != _FORMAT:
                raise ValueError(f"format {header.get('format')!r}")
            stored = [archive[f"leaf_{i}"] for i in range(len(header["leaves"]))]
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        EOFError,
        zipfile.BadZipFile,
    ) as error:
        raise ValueError(
            f"path={str(path)!r} is not a readable px.save_model file ({error}); "
            "it may be truncated or corrupt: save the model again"
        ) from None
    check_same_specs(
        [[f"model{path}", *rest] for path, *rest in leaf_specs(like)[1]],
        [[f"model{path}", *rest] for path, *rest in header["leaves"]],
        stored=f"path={str(path)!r}",
        kind="model",
        mine="`like`",
        fix="build `like` exactly as the saved model was built",
    )
    arrays = iter(jax.numpy.asarray(array) for array in stored)
    return jax.tree.map(lambda leaf: next(arrays) if eqx.is_array(leaf) else leaf, like)
