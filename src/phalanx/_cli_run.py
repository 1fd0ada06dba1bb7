"""The training run behind ``phalanx train``, once every argument is valid."""

import shutil
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import optax

from . import callbacks as cb, models
from ._callback import Callback
from ._cli_args import TrainArgs, UsageError, write_config
from ._cli_model import build_model, model_args, model_factory
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
    from ._cli_train import Split


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


def make_model(
    args: "TrainArgs", in_shape: tuple[int, ...], classes: int
) -> tuple[Any, str]:
    """The model --model names, and how the banner names it."""
    key = jax.random.key(args.seed)
    if args.user_model:
        arguments = model_args(args.model_arg)
        factory = model_factory(args.model, arguments)
        model = build_model(
            args.model,
            factory,
            arguments,
            in_shape=tuple(in_shape),
            out_size=classes,
            key=key,
        )
        shape = "x".join(map(str, in_shape))
        return model, f"{type(model).__name__} ({args.model}) {shape} -> {classes}"
    (features,) = in_shape
    if args.model == "linear":
        return models.Linear(features, classes, key=key), f"LINEAR {features}-{classes}"
    widths = "-".join(map(str, (features, *args.hidden, classes)))
    return models.MLP(features, classes, hidden=args.hidden, key=key), f"MLP {widths}"


def make_loggers(args: "TrainArgs") -> list[Callback]:
    """The --logger callbacks, writing into the run folder (W&B and MLflow:
    where their own settings say, the run's options as its config)."""
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
    return [made[name]() for name in dict.fromkeys(args.loggers)]


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
    classes = int(y_train.max()) + 1
    model, name = make_model(args, x_train.shape[1:], classes)
    loader = ArrayLoader((x_train, y_train), args.batch_size, seed=args.seed)
    test_loader = ArrayLoader((x_test, y_test), args.batch_size, shuffle=False)
    schedule = make_schedule(args, args.epochs * len(loader))

    run = args.run_dir
    main = jax.process_index() == 0  # files and lines are written once
    run.mkdir(parents=True, exist_ok=True)
    if main and not args.resume:
        for file in ("metrics.csv", "metrics.jsonl", "history.png"):
            (run / file).unlink(missing_ok=True)
        for events in (run / "tensorboard").glob("events.out.tfevents.*"):
            events.unlink()
        for step in (run / "checkpoints").glob("[0-9]*"):
            shutil.rmtree(step)
        shutil.rmtree(run / "profile", ignore_errors=True)
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
            *make_loggers(args),
            cb.PlotHistory(run / "history.png"),
            cb.ProgressBar(log_every=every),
            *(
                ()
                if args.profile is None
                else [cb.Profiler(run / "profile", steps=args.profile)]
            ),
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
    if main:  # the options of the run as it goes on from here
        write_config(args)
    sizes = f"{len(x_train)} train / {len(x_test)} test"
    say(
        f"phalanx: {name} on {args.dataset} ({sizes}), "
        f"{type(strategy).__name__} on {len(devices)} {devices[0].platform} "
        f"device(s), batch {args.batch_size}, {args.epochs} "
        f"epoch{'s' if args.epochs != 1 else ''}"
        + ("" if args.precision == "fp32" else f", {args.precision}")
    )
    say(f"phalanx: {trainer.summary().short()}")
    trainer.fit(
        loader,
        epochs=args.epochs,
        eval_data=test_loader,
        eval_every=args.eval_every,
        resume=resume,
    )
    results = trainer.evaluate(test_loader)
    say(
        f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f}; "
        f"logs in {run}"
    )
    return 0


def _quiet(*args: object, **kwargs: object) -> None:
    """print, on processes other than 0."""
    del args, kwargs
