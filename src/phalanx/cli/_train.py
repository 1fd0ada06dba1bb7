"""The training run behind ``phalanx train``, once every argument is valid."""

import functools as ft
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

from .. import callbacks as cb, models
from .._checks._device_note import devices_said
from .._telemetry._peak_flops import peak_flops
from .._trainer import DataParallelTrainer
from ..callbacks._base import Callback
from ..data import ArrayLoader, GrainLoader, Records
from ..strategies import Strategy
from ..strategies._registry import Options, build, lookup
from ._args import TrainArgs, UsageError, write_config
from ._folder import RunFolder
from ._model import (
    DIGITS_HINT,
    build_model,
    check_model,
    model_args,
    model_factory,
)
from ._values import mesh_sizes


if TYPE_CHECKING:
    from ._datasets import Split
    from ._outputs import Outputs


def make_schedule(args: "TrainArgs", total_steps: int) -> optax.Schedule:
    if args.schedule == "constant":
        return optax.constant_schedule(args.lr)
    if args.schedule == "cosine":
        return optax.cosine_decay_schedule(args.lr, total_steps)
    warmup = max(1, min(100, total_steps // 10))
    return optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, total_steps)


def make_optimizer(
    args: "TrainArgs", learning_rate: optax.ScalarOrSchedule
) -> optax.GradientTransformation:
    """The optimizer --optimizer names, at `learning_rate`, after
    --clip-norm's clipping."""
    build = {
        "adam": optax.adam,
        "adamw": optax.adamw,
        "sgd": ft.partial(optax.sgd, momentum=0.9),
    }[args.optimizer]
    optimizer = build(learning_rate=learning_rate)
    if args.clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(args.clip_norm), optimizer)
    return optimizer


def make_loader(
    args: "TrainArgs", x: Any, y: np.ndarray, *, shuffle: bool = True
) -> ArrayLoader | GrainLoader:
    """Batches of `x` and `y`: an `ArrayLoader` of arrays in memory, or a
    `GrainLoader` reading a `records:` split from disk."""
    if isinstance(x, Records):
        return GrainLoader(
            x.dataset(),
            args.batch_size,
            seed=args.seed,
            shuffle=shuffle,
            worker_count=args.data_workers,
        )
    return ArrayLoader((x, y), args.batch_size, seed=args.seed, shuffle=shuffle)


def make_model(args: "TrainArgs", x: np.ndarray, y: np.ndarray) -> tuple[Any, str]:
    """The model --model names for examples `x` and labels `y`, and how the
    banner names it. A user's model is traced on one example first: its
    output must fit the labels.

    Raises:
        UserCodeError: the user's factory or model raised.
        UsageError: the user's model does not fit the labels.
    """
    in_shape, classes = tuple(x.shape[1:]), int(y.max()) + 1
    key = jax.random.key(args.seed)
    if args.user_model:
        # The likely cause when a user's model fails on the built-in data.
        hint = DIGITS_HINT if args.dataset == "digits" else ""
        arguments = model_args(args.model_arg)
        factory = model_factory(args.model, arguments)
        model = build_model(
            args.model,
            factory,
            arguments,
            in_shape=in_shape,
            out_size=classes,
            key=key,
            hint=hint,
        )
        check_model(args.model, model, x, y, hint)
        shape = "x".join(map(str, in_shape))
        return model, f"{type(model).__name__} ({args.model}) {shape} -> {classes}"
    (features,) = in_shape
    if args.model == "linear":
        return models.Linear(features, classes, key=key), f"LINEAR {features}-{classes}"
    widths = "-".join(map(str, (features, *args.hidden, classes)))
    return models.MLP(features, classes, hidden=args.hidden, key=key), f"MLP {widths}"


def make_loggers(args: "TrainArgs", loggers: tuple[str, ...]) -> list[Callback]:
    """The callbacks of `loggers` (--logger names), writing into the run
    folder (W&B and MLflow: where their own settings say, the run's options
    as its config).

    Raises:
        UsageError: a logger's library cannot be imported.
    """
    run, every = args.run_dir, args.log_every
    config = args.config()
    made: dict[str, Callable[[], Callback]] = {
        "csv": lambda: cb.CSVLogger(run / "metrics.csv", log_every=every),
        "jsonl": lambda: cb.JSONLogger(run / "metrics.jsonl", log_every=every),
        "tensorboard": lambda: cb.TensorBoardLogger(
            run / "tensorboard", log_every=every
        ),
        "wandb": lambda: cb.WandbLogger(config=config, log_every=every, dir=str(run)),
        "mlflow": lambda: cb.MLflowLogger(
            run_name=run.name, config=config, log_every=every
        ),
    }
    out = []
    for name in loggers:
        try:
            out.append(made[name]())
        except ImportError as error:  # found, yet it does not import
            raise UsageError(f"--logger {name}: {error} ({error.__cause__})") from None
    return out


def make_plot(path: Path) -> list[cb.PlotHistory]:
    """A `PlotHistory` drawing `path`.

    Raises:
        UsageError: matplotlib cannot be imported.
    """
    try:
        return [cb.PlotHistory(path)]
    except ImportError as error:  # found, yet it does not import
        raise UsageError(f"{error} ({error.__cause__}); or pass --no-plot") from None


def make_strategy(args: "TrainArgs", devices: list[Any]) -> Strategy:
    """The strategy the options ask for, on `devices`: the registered
    strategy named by --strategy, with the options it reads (--shard,
    --mesh), wrapped for --microbatches.

    Raises:
        UsageError: --mesh sizes that do not fit the devices.
    """
    entry = lookup(args.strategy)
    reads_mesh = "mesh" in entry.options
    options = Options(
        shard=args.shard,
        # --strategy mesh without --mesh: data parallel over every device.
        mesh=mesh_sizes(args.mesh or "data=-1") if reads_mesh else None,
    )
    try:
        return build(args.strategy, devices, options, args.microbatches)
    except ValueError as error:  # sizes that do not fit the devices
        if not reads_mesh:
            raise
        raise UsageError(f"--mesh {args.mesh}: {error}") from None


def train_and_report(
    args: "TrainArgs",
    devices: list[Any],
    train: "Split",
    test: "Split",
    *,
    defaulted: bool,
    outputs: "Outputs",
    folder: RunFolder,
) -> int:
    """Build and run the training; every argument has been checked, except
    that a --resume checkpoint matches the model (refused as a UsageError).
    The run writes into `folder` only once the model has been built and
    checked; the caller undoes a failed start there."""
    (x_train, y_train), (x_test, y_test) = train, test
    model, name = make_model(args, x_train, y_train)
    loader = make_loader(args, x_train, y_train)
    test_loader = make_loader(args, x_test, y_test, shuffle=False)
    # The schedule's length is the run's, fixed at its start (config.toml).
    args = args.with_schedule_steps(len(loader))
    schedule = make_schedule(args, args.schedule_length(len(loader)))

    strategy = make_strategy(args, devices)
    run = args.run_dir
    main = jax.process_index() == 0  # files and lines are written once
    folder.create(main=main)
    every = args.log_every
    checkpoint = cb.Checkpoint(run / "checkpoints", every_n_steps=args.checkpoint_every)
    plots = make_plot(run / "history.png") if outputs.plot else []
    trainer = DataParallelTrainer(
        model,
        make_optimizer(args, schedule),
        # The classifier's accuracy, and what --metric adds (repeats dropped).
        metrics=("accuracy", *args.metrics),
        strategy=strategy,
        seed=args.seed,
        steps_per_call=args.steps_per_call,
        slow_steps=args.slow_steps,
        hang_timeout=args.hang_timeout,
        precision=args.precision,
        callbacks=[
            # The start line says where there is no mfu (`flops_note`).
            cb.Throughput(log_every=every, quiet=True),
            cb.LearningRateMonitor(schedule, log_every=every),
            # Always: the phase clock runs anyway, and its time/<phase> and
            # goodput metrics reach the loggers (it adds metrics: it runs first).
            cb.Timeline(
                run / "timeline.json",
                trace=run / "trace.json" if args.telemetry else None,
                table=args.telemetry,
                # A resumed run's timeline.json holds its earlier parts too.
                keep_earlier=args.resume,
            ),
            *make_loggers(args, outputs.loggers),
            *plots,
            cb.ProgressBar(log_every=every),
            *(
                ()
                if args.profile is None
                else [cb.Profiler(run / "profile", steps=args.profile)]
            ),
            checkpoint,
            folder.marker,
        ],
    )
    resume = None
    if args.resume:
        try:  # the newest readable checkpoint, read once in full here
            resume = checkpoint.check(trainer) or "latest"
        except (FileNotFoundError, ValueError) as error:
            raise UsageError(f"--resume: {error}") from None
    say = print if main else _quiet
    rows = min(args.batch_size // jax.process_count(), len(x_train))
    first = (x_train[:rows], y_train[:rows])  # as large as the loader's
    notes = (outputs.note, args.schedule_note(len(loader)))
    for line in start_notes(defaulted, *notes):
        say(line, file=sys.stderr)
    if main:  # the options of the run as it goes on from here
        write_config(args)
    epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
    say(banner(args, name, train, test, strategy, devices, epochs))
    say(f"phalanx: {trainer.summary().short()}{flops_note(trainer, first, devices)}")
    devices_said()  # the banner above names them: no API note on top
    try:
        trainer.fit(
            loader,
            epochs=args.epochs,
            eval_data=test_loader,
            eval_every=args.eval_every,
            resume=resume,
        )
        results = trainer.evaluate(test_loader)
    finally:  # a GrainLoader's worker processes end with the run
        for batches in (loader, test_loader):
            if isinstance(batches, GrainLoader):
                batches.close()
    scores = ", ".join(  # a confusion matrix is in metrics.jsonl, not here
        f"test {name} {value:.4f}"
        for name, value in results.items()
        if not isinstance(value, np.ndarray)
    )
    say(f"{scores}; logs in {run}")
    for plot in plots:  # its last drawing ran while the test set was evaluated
        plot.wait()
    return 0


def flops_note(trainer: DataParallelTrainer, batch: Any, devices: list[Any]) -> str:
    """The end of the start line: the train step's FLOPs (counted, not
    compiled), and where the devices' peak is unknown that `Throughput`
    logs no ``mfu`` (said here, once, instead of by `Throughput`)."""
    flops = trainer.flops_per_step(batch)
    kind = devices[0].device_kind
    compute = np.dtype(trainer.precision.compute)
    note = "" if flops is None else f"; {flops.short()}"
    if peak_flops(kind, compute) is None:
        note += f" (no mfu: no peak FLOP/s known for {kind!r} devices)"
    return note


def start_notes(defaulted: bool, *notes: str | None) -> list[str]:
    """The lines on stderr before a run's banner: the devices chosen by
    default, if they were, then each of `notes` given."""
    chosen = (
        "phalanx: no accelerator found; using 8 fake CPU devices "
        "(--devices N to change)"
        if defaulted
        else None
    )
    return [note for note in (chosen, *notes) if note is not None]


def banner(
    args: "TrainArgs",
    name: str,
    train: "Split",
    test: "Split",
    strategy: Strategy,
    devices: list[Any],
    *also: str,
) -> str:
    """The line that says what runs: the model (as `make_model` names it),
    the data, the strategy on its devices, the batch, `also`, the precision
    where not fp32."""
    sizes = f"{len(train[0])} train / {len(test[0])} test"
    parts = [
        f"{name} on {args.dataset} ({sizes})",
        f"{type(strategy).__name__} on {len(devices)} {devices[0].platform} device(s)",
        f"batch {args.batch_size}",
        *also,
        *([] if args.precision == "fp32" else [args.precision]),
    ]
    return f"phalanx: {', '.join(parts)}"


def _quiet(*args: object, **kwargs: object) -> None:
    """print, on processes other than 0."""
    del args, kwargs
