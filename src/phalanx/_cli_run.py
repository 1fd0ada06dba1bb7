"""The training run behind ``phalanx train``, once every argument is valid."""

import shutil
import sys
from typing import TYPE_CHECKING, Any

import jax
import optax

from . import callbacks as cb, models
from ._cli_train import UsageError
from ._trainer import DataParallelTrainer
from .data import ArrayLoader
from .strategies import (
    AccumulatingStrategy,
    FullyShardedStrategy,
    PmapStrategy,
    ShardingStrategy,
    Strategy,
)


if TYPE_CHECKING:
    from ._cli_train import Split, TrainArgs


def make_schedule(args: "TrainArgs", total_steps: int) -> optax.Schedule:
    if args.schedule == "constant":
        return optax.constant_schedule(args.lr)
    if args.schedule == "cosine":
        return optax.cosine_decay_schedule(args.lr, total_steps)
    warmup = max(1, min(100, total_steps // 10))
    return optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, total_steps)


def make_optimizer(args: "TrainArgs", schedule: optax.Schedule):
    optimizer = {
        "adam": lambda: optax.adam(schedule),
        "adamw": lambda: optax.adamw(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
    }[args.optimizer]()
    if args.clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(args.clip_norm), optimizer)
    return optimizer


def make_strategy(args: "TrainArgs", devices: list[Any]) -> Strategy:
    if args.strategy == "fsdp":
        inner = FullyShardedStrategy(devices, shard=args.shard or "all")
    elif args.strategy == "pmap":
        inner = PmapStrategy(devices)
    else:
        inner = ShardingStrategy(devices)
    if args.microbatches > 1:
        return AccumulatingStrategy(inner, args.microbatches)
    return inner


def train_and_report(
    args: "TrainArgs",
    devices: list[Any],
    train: "Split",
    test: "Split",
    *,
    defaulted: bool,
) -> int:
    """Build and run the training; every argument has been checked, except
    that a --resume checkpoint matches the model (refused as a UsageError)."""
    (x_train, y_train), (x_test, y_test) = train, test
    features, classes = x_train.shape[1], int(y_train.max()) + 1
    key = jax.random.key(args.seed)
    if args.model == "linear":
        model = models.Linear(features, classes, key=key)
    else:
        model = models.MLP(features, classes, hidden=args.hidden, key=key)
    loader = ArrayLoader((x_train, y_train), args.batch_size, seed=args.seed)
    test_loader = ArrayLoader((x_test, y_test), args.batch_size, shuffle=False)
    schedule = make_schedule(args, args.epochs * len(loader))

    run = args.run_dir
    main = jax.process_index() == 0  # files and lines are written once
    run.mkdir(parents=True, exist_ok=True)
    if main and not args.resume:
        for name in ("metrics.csv", "metrics.jsonl", "history.png"):
            (run / name).unlink(missing_ok=True)
        for events in (run / "tensorboard").glob("events.out.tfevents.*"):
            events.unlink()
        for step in (run / "checkpoints").glob("[0-9]*"):
            shutil.rmtree(step)
    every = args.log_every
    strategy = make_strategy(args, devices)
    checkpoint = cb.Checkpoint(run / "checkpoints", every_n_steps=args.checkpoint_every)
    trainer = DataParallelTrainer(
        model,
        make_optimizer(args, schedule),
        strategy=strategy,
        seed=args.seed,
        steps_per_call=args.steps_per_call,
        precision=args.precision,
        callbacks=[
            cb.Throughput(log_every=every),
            cb.LearningRateMonitor(schedule, log_every=every),
            cb.CSVLogger(run / "metrics.csv", log_every=every),
            cb.JSONLogger(run / "metrics.jsonl", log_every=every),
            cb.TensorBoardLogger(run / "tensorboard", log_every=every),
            cb.PlotHistory(run / "history.png"),
            cb.ProgressBar(log_every=every),
            checkpoint,
        ],
    )
    resume = None
    if args.resume:
        try:  # the newest readable checkpoint, read once in full here
            resume = checkpoint.check(trainer) or "latest"
        except (FileNotFoundError, ValueError) as error:
            raise UsageError(f"--resume: {error}") from None
    say = print if main else _quiet
    if defaulted:
        say(
            "phalanx: no accelerator found; using 8 fake CPU devices "
            "(--devices N to change)",
            file=sys.stderr,
        )
    hidden = "-".join(map(str, args.hidden)) if args.model == "mlp" else ""
    say(
        f"phalanx: {args.model.upper()} {features}-{hidden + '-' if hidden else ''}"
        f"{classes} on {args.dataset} ({len(x_train)} train / {len(x_test)} test), "
        f"{type(strategy).__name__} on {len(devices)} {devices[0].platform} "
        f"device(s), batch {args.batch_size}, {args.epochs} "
        f"epoch{'s' if args.epochs != 1 else ''}"
        + ("" if args.precision == "fp32" else f", {args.precision}")
    )
    trainer.fit(loader, epochs=args.epochs, eval_data=test_loader, resume=resume)
    results = trainer.evaluate(test_loader)
    say(
        f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}; "
        f"logs in {run}"
    )
    return 0


def _quiet(*args: object, **kwargs: object) -> None:
    """print, on processes other than 0."""
    del args, kwargs
