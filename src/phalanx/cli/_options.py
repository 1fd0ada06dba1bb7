"""The options ``phalanx train`` and ``phalanx find-lr`` share: the model
and its data, how a step runs across the devices, the optimizer, and the
output folder. Defined once, so that a range test runs the very model,
strategy and optimizer the training will, and says its options as
``phalanx train``'s flags. Like the parser it imports no JAX."""

import argparse
from collections.abc import Callable

from ..strategies._registry import registered
from ._values import (
    mesh,
    model,
    model_arg,
    non_negative_int,
    positive_float,
    positive_int,
    widths,
)


# A parser's add_argument.
Add = Callable[..., argparse.Action]
# --optimizer's names (`cli/_train.make_optimizer` builds each).
OPTIMIZERS = ("adam", "adamw", "sgd")


def add_model_options(add: Add) -> None:
    """--model, --model-arg, --hidden and --dataset."""
    add(
        "--model",
        type=model,
        default="mlp",
        metavar="linear|mlp|MODULE:FACTORY",
        help="a built-in model, or FACTORY(*, in_shape, out_size, key, "
        "**model_args) in MODULE (imported from the current folder or "
        "PYTHONPATH) returning an Equinox module; in_shape is one example's "
        "shape, out_size the number of classes",
    )
    add(
        "--model-arg",
        type=model_arg,
        action="append",
        metavar="NAME=VALUE",
        help="a keyword argument for --model MODULE:FACTORY, VALUE a Python "
        "literal (repeatable), e.g. --model-arg channels=16",
    )
    add(
        "--hidden",
        type=widths,
        default="256,128",
        metavar="W1,W2,...",
        help="hidden layer widths of the MLP",
    )
    add(
        "--dataset",
        default="digits",
        metavar="digits|mnist:PATH|npz:PATH|records:DIR|MODULE:FUNCTION",
        help="bundled digits, MNIST IDX files in PATH, an .npz with x_train, "
        "y_train, x_test, y_test, ArrayRecord splits train and test in DIR "
        "(px.data.write_records; read from disk as the run goes, through "
        "grain: larger than memory), or FUNCTION() in MODULE returning those "
        "four NumPy arrays",
    )
    add(
        "--data-workers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="with --dataset records:DIR, processes decoding examples ahead "
        "(grain's workers; 0: threads of the trainer's process)",
    )


def add_device_options(add: Add) -> None:
    """--strategy, --mesh, --shard, --microbatches, --devices, --batch-size
    and --precision: how a step runs."""
    # The choices are the strategy registry's, read as the parser is built.
    entries = registered()
    summaries = [entry.summary for entry in entries]
    add(
        "--strategy",
        choices=tuple(entry.name for entry in entries),
        default=entries[0].name,
        help=" or ".join([", ".join(summaries[:-1]), summaries[-1]])
        if len(summaries) > 1
        else summaries[0],
    )
    add(
        "--mesh",
        type=mesh,
        default=None,
        metavar="AXIS=SIZE,...",
        help="with --strategy mesh: the sizes of its data, fsdp and context "
        "axes, e.g. data=2,fsdp=4 (data -1 unless given: what the others "
        "leave); context=K splits each example's sequence, dimension 1 of x "
        "and y, over K devices; tensor needs sharding rules, which only the "
        "Python API takes",
    )
    add(
        "--shard",
        choices=("all", "optimizer"),
        default=None,
        help="with --strategy fsdp: split parameters and optimizer state (all, "
        "the default) or the optimizer state only",
    )
    add(
        "--microbatches",
        type=positive_int,
        default=1,
        metavar="K",
        help="gradient accumulation: split each device's batch in K parts",
    )
    add(
        "--devices",
        type=positive_int,
        default=None,
        metavar="N",
        help="devices to train on; on a CPU-only host this fakes N CPU devices "
        "(default 8), on accelerators the default is all of them",
    )
    add(
        "--batch-size",
        type=positive_int,
        default=64,
        metavar="N",
        help="global batch size: examples per step over every device, padded "
        "with weight-0 examples up to a multiple of devices x microbatches (a "
        "multiple wastes nothing)",
    )
    add(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="float32 throughout, or float32 weights with the forward and "
        "backward pass in bfloat16 or float16 (fp16: with a dynamic loss scale)",
    )


def add_optimizer_options(add: Add) -> None:
    """--optimizer, --clip-norm and --seed."""
    sgd = "optax optimizer (sgd uses momentum 0.9)"
    add("--optimizer", choices=OPTIMIZERS, default="sgd", help=sgd)
    add(
        "--clip-norm",
        type=positive_float,
        default=None,
        metavar="C",
        help="clip gradients to this global norm",
    )
    add("--seed", type=int, default=0, help="seeds initialisation, shuffling, dropout")


def add_compile_cache_options(add: Add) -> None:
    """--compile-cache and --no-compile-cache (_telemetry/_compile_cache.py)."""
    add(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="keep compiled programs in DIR for the next run to read (JAX's "
        "persistent compilation cache; default $JAX_COMPILATION_CACHE_DIR, "
        "else phalanx/jax under $XDG_CACHE_HOME or ~/.cache)",
    )
    add(
        "--no-compile-cache",
        action="store_true",
        help="compile every program afresh, reading and writing no cache",
    )


def add_folder_options(add: Add, *, what: str, plot: str) -> None:
    """--run-dir, --overwrite and --no-plot, for a command that writes
    `what` and draws the image `plot`."""
    add(
        "--run-dir",
        default=None,
        metavar="DIR",
        help=f"where {what} go (default runs/<date-time>); must be new or empty",
    )
    add(
        "--overwrite",
        action="store_true",
        help="allow a non-empty --run-dir (files phalanx writes are replaced; "
        "others are left alone)",
    )
    add(
        "--no-plot",
        action="store_true",
        help=f"draw no {plot} (drawn by default where matplotlib is "
        "installed: pip install 'phalanx[logs]')",
    )
