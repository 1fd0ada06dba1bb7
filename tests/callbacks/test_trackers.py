"""Experiment trackers: W&B (offline) and MLflow (a local file store). Every
value logged is read back from the tracker's own storage, across a crash
and a resume: each logged step exactly once, with the uninterrupted run's
values."""

import functools
import logging
import pathlib
import signal
import socket
import sys

import mlflow
import optax
import pytest
import wandb
from typing_extensions import override

import phalanx as px
from helpers import RaiseAt, make_data, make_model, wandb_parts
from phalanx._preemption import Preempted
from phalanx._typing import MetricValue
from phalanx.callbacks import (
    Checkpoint,
    CSVLogger,
    MLflowLogger,
    TrackerError,
    WandbLogger,
)
from phalanx.callbacks._hparams import hyperparameters
from phalanx.callbacks._wandb_log import (
    history_steps,
    transaction_log,
    wait_until_written,
)


STEPS_PER_EPOCH, EPOCHS, LOG_EVERY = 4, 3, 2
CONFIG = {"lr": 0.01, "data": {"batch": 16, "name": "blobs"}}
TRAINER_PARAMS = {
    "strategy": "ShardingStrategy",
    "strategy.num_devices": 8,
    "precision": "fp32",
    "steps_per_call": 1,
    "nan_policy": "raise",
    "sync_every": 16,
    "model": "MLP",
    "model.parameters": 5 * 8 + 8 + 8 * 3 + 3,
    "optimizer_state": "ScaleByAdamState",
}


def batches():
    x, y = make_data(STEPS_PER_EPOCH * 16)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]


def eval_batches():
    return [make_data(24, seed=1)]


class Record(px.Callback):
    """What a logger with `LOG_EVERY` logs, by tag: [(step, value)]."""

    def __init__(self):
        self.logged: dict[str, list[tuple[int, MetricValue]]] = {}

    @override
    def on_step_end(self, info):
        if info.step % LOG_EVERY == 0:
            for name, value in info.metrics.items():
                self.logged.setdefault(f"train/{name}", []).append((info.step, value))

    @override
    def on_epoch_end(self, info):
        for name, value in info.metrics.items():
            tag = f"eval/{name[5:]}" if name.startswith("eval_") else f"epoch/{name}"
            self.logged.setdefault(tag, []).append((info.step, value))


@pytest.fixture(scope="module")
def expected() -> dict[str, list[tuple[int, MetricValue]]]:
    """The uninterrupted run's values at every log point."""
    record = Record()
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[record])
    trainer.fit(batches(), epochs=EPOCHS, eval_data=eval_batches())
    steps = [s for s, _ in record.logged["train/loss"]]
    assert steps == list(range(LOG_EVERY, STEPS_PER_EPOCH * EPOCHS + 1, LOG_EVERY))
    return record.logged


def crash_and_resume(tmp_path, make_logger, crash_at: int) -> tuple[Record, Record]:
    """Fit with a checkpoint each epoch, crash at step `crash_at` (after the
    logger's hooks), then resume in a new trainer with a new logger. Returns
    what each process's loggers were handed."""
    records = []
    for crash in (crash_at, None):
        record = Record()
        callbacks = [make_logger(), record, Checkpoint(tmp_path / "checkpoints")]
        if crash is not None:
            callbacks.append(RaiseAt(crash))
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), callbacks=callbacks
        )
        if crash is None:
            trainer.fit(
                batches(), epochs=EPOCHS, eval_data=eval_batches(), resume="latest"
            )
        else:
            with pytest.raises(RuntimeError, match=f"boom at step {crash}"):
                trainer.fit(batches(), epochs=EPOCHS, eval_data=eval_batches())
        records.append(record)
    return records[0], records[1]


# --------------------------------------------------------------------- W&B


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> pathlib.Path:
    """The root of a test's W&B folders, under tmp_path (no network exists
    here). W&B reads its environment once per process: each run is also given
    its folder (``dir=``)."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wb"


# No console capture (pytest captures), system metrics or git lookups.
QUIET = {"console": "off", "x_disable_stats": True, "disable_git": True}


def offline_logger(folder: pathlib.Path, **kwargs) -> WandbLogger:
    return WandbLogger(
        "phalanx-tests",
        mode="offline",
        config=CONFIG,
        log_every=LOG_EVERY,
        dir=str(folder),
        settings=wandb.Settings(**QUIET),
        **kwargs,
    )


def test_wandb_offline_resume_logs_each_step_once(wandb_dir, tmp_path, expected):
    make_logger = functools.partial(offline_logger, wandb_dir)
    crashed, resumed = crash_and_resume(tmp_path, make_logger, crash_at=7)
    # The crashed process logged step 6, after its checkpoint at step 4; the
    # resumed one saw step 6 again, identically, and did not log it.
    assert crashed.logged["train/loss"][-1] == expected["train/loss"][2]
    assert resumed.logged["train/loss"][0] == expected["train/loss"][2]

    first, second = parts = wandb_parts(wandb_dir)
    assert first["id"] == second["id"]  # one run, in two parts
    assert sorted(first["rows"]) == [2, 4, 6]
    assert sorted(second["rows"]) == [8, 10, 12]
    assert (first["exit_code"], second["exit_code"]) == (1, 0)  # failed, finished
    logged: dict[str, list[tuple[int, float]]] = {}
    for part in parts:
        for step, row in sorted(part["rows"].items()):
            for tag, value in row.items():
                if not tag.startswith("_"):
                    logged.setdefault(tag, []).append((step, value))
    assert logged == expected  # every tag, every step once, exact values

    for part in parts:
        config = part["config"]
        assert {k: config[k] for k in TRAINER_PARAMS} == TRAINER_PARAMS
        assert config["strategy.deterministic"] is False
        assert (config["lr"], config["data"]) == (CONFIG["lr"], CONFIG["data"])


def test_wandb_continues_its_run_in_a_later_fit(wandb_dir, caplog):
    """A second fit of the same logger continues its run: one id, steps on.
    (The run with the id given exists already, with no steps.)"""
    empty = wandb.init(
        project="phalanx-tests",
        mode="offline",
        id="later-fit",
        dir=wandb_dir,
        settings=wandb.Settings(**QUIET),
        reinit="create_new",
    )
    empty.finish()
    wait_until_written(pathlib.Path(empty.settings.sync_file))
    logger = offline_logger(wandb_dir, id="later-fit", name="two fits")
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[logger])
    trainer.fit(batches(), epochs=1)
    assert logger.run is None  # finished
    assert logger.state_dict() == {
        "run_id": "later-fit",
        "project": "phalanx-tests",
        "last_step": 4,
    }
    with caplog.at_level(logging.INFO, logger="phalanx"):
        trainer.fit(batches(), epochs=1)
    assert "continuing W&B run later-fit; steps up to 4" in caplog.text
    parts = wandb_parts(wandb_dir)[1:]
    assert [part["id"] for part in parts] == ["later-fit"] * 2
    assert [part["name"] for part in parts] == ["two fits"] * 2  # init_kwargs
    assert [sorted(part["rows"]) for part in parts] == [[2, 4], [6, 8]]
    assert sorted(parts[1]["rows"][8]) == [
        "_runtime",
        "_timestamp",
        "epoch/accuracy",
        "epoch/loss",
        "train/accuracy",
        "train/loss",
    ]


def test_wandb_transaction_log_across_blocks(wandb_dir):
    """Records span W&B's 32 KiB blocks; reading can start at one; a torn
    or damaged record ends the file."""
    run = wandb.init(
        project="phalanx-tests",
        mode="offline",
        dir=wandb_dir,
        settings=wandb.Settings(**QUIET),
        reinit="create_new",
    )
    for step in range(300):
        run.log({"payload": "x" * 100}, step=step)
    run.finish()
    path = pathlib.Path(run.settings.sync_file)
    wait_until_written(path)
    data = path.read_bytes()
    assert len(data) > 3 * 32768
    assert list(history_steps(path)) == list(range(300))
    # From a block boundary inside the file: the records that begin after it.
    records = [r.SerializeToString() for r in transaction_log(path)]
    tail = [r.SerializeToString() for r in transaction_log(path, tail=40000)]
    assert 10 < len(tail) < len(records) and tail == records[-len(tail) :]
    for damaged in (
        data[: len(data) // 2],  # torn: the process died writing
        data[:40000] + bytes([data[40000] ^ 1]) + data[40001:],  # a CRC mismatch
    ):
        path.write_bytes(damaged)
        steps = list(history_steps(path))
        assert 50 < len(steps) < 300 and steps == list(range(len(steps)))
    path.write_bytes(b"not a log" + data)
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(history_steps(path))


def test_wandb_arguments_checked_when_built(wandb_dir):
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=rf"log_every={bad!r} must be an int >= 1"):
            WandbLogger("p", log_every=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"mode='local' must be 'online', 'offline'"):
        WandbLogger("p", mode="local")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"project=3 must be a str or None"):
        WandbLogger(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"config=\['lr'\] must be a mapping"):
        WandbLogger("p", config=["lr"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"config has the key 1; its keys must be str"):
        WandbLogger("p", config={1: 2})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"entiy='me' is not an argument of wandb.init"):
        WandbLogger("p", entiy="me")
    with pytest.raises(ValueError, match=r"resume='must': WandbLogger resumes its own"):
        WandbLogger("p", resume="must")
    with pytest.raises(TypeError, match=r"id=7 must be a str"):
        WandbLogger("p", id=7)
    assert not wandb_dir.exists()  # nothing is written before fit


# ------------------------------------------------------------------ MLflow


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch) -> str:
    # MLflow 3 refuses a file store unless told (it prefers a database, which
    # mlflow-skinny cannot open).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def mlflow_history(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }


def test_mlflow_resume_logs_each_step_once(tmp_path, tracking_uri, expected):
    def make_logger():
        return MLflowLogger(
            "phalanx-tests",
            tracking_uri=tracking_uri,
            run_name="resumed",
            config=CONFIG,
            log_every=LOG_EVERY,
        )

    # The crash at step 8 comes after the logger logged the step's metrics and
    # before the epoch ended: the resumed run logs the epoch's, not the step's.
    crashed, resumed = crash_and_resume(tmp_path, make_logger, crash_at=8)
    assert crashed.logged["train/loss"][-1] == expected["train/loss"][3]
    assert resumed.logged["train/loss"][:2] == expected["train/loss"][2:4]

    client = mlflow.MlflowClient(tracking_uri)
    [experiment] = [e for e in client.search_experiments() if e.name == "phalanx-tests"]
    [run] = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("resumed", "FINISHED")
    history = mlflow_history(client, run.info.run_id)
    assert history == expected  # every tag, every step once, exact values

    params = run.data.params
    assert {k: params[k] for k in TRAINER_PARAMS} == {
        k: str(v) for k, v in TRAINER_PARAMS.items()
    }
    assert (params["lr"], params["data.batch"], params["data.name"]) == (
        "0.01",
        "16",
        "blobs",
    )


def test_mlflow_run_states_names_and_changed_params(tmp_path, tracking_uri, caplog):
    class AddHostValues(px.Callback):
        @override
        def on_step_end(self, info):
            info.metrics["top@5/all"] = 0.5
            info.metrics["bad"] = float("nan")

    logger = MLflowLogger(
        tracking_uri=tmp_path / "mlruns", config={"tag": "a"}, log_every=1
    )
    assert logger.tracking_uri == tracking_uri
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[AddHostValues(), logger, RaiseAt(2)]
    )
    with pytest.raises(RuntimeError, match="boom at step 2"):
        trainer.fit(batches(), epochs=1)
    client = mlflow.MlflowClient(tracking_uri)
    assert logger.run_id is not None
    assert client.get_run(logger.run_id).info.status == "FAILED"
    assert client.get_run(logger.run_id).info.experiment_id == "0"  # the default

    # A new logger continues the run, where the state says it is.
    state = logger.state_dict()
    assert state == {"run_id": logger.run_id, "tracking_uri": tracking_uri}
    logger = MLflowLogger(config={"tag": "b"}, log_every=1)
    logger.load_state_dict(state)
    trainer.callbacks = [AddHostValues(), logger]
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        trainer.fit(batches(), epochs=1)
    assert "keeps tag='a'; this fit's 'b' is not logged" in caplog.text
    assert logger.run_id is not None
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["tag"] == "a"
    history = mlflow_history(client, logger.run_id)
    assert [s for s, _ in history["train/top_5_all"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in history["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert all(v != v for _, v in history["train/bad"])  # NaN logged as NaN
    assert [s for s, _ in history["epoch/loss"]] == [6]


def test_mlflow_arguments_checked_when_built(tmp_path):
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=rf"log_every={bad!r} must be an int >= 1"):
            MLflowLogger("e", log_every=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"experiment=3 must be a str or None"):
        MLflowLogger(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"experiment='' names no experiment"):
        MLflowLogger("")
    with pytest.raises(TypeError, match=r"run_name=\['a'\] must be a str or None"):
        MLflowLogger("e", run_name=["a"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        TypeError, match=r"tracking_uri=5 must be a str, a path or None"
    ):
        MLflowLogger("e", tracking_uri=5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"config='lr' must be a mapping"):
        MLflowLogger("e", config="lr")  # pyright: ignore[reportArgumentType]
    assert list(tmp_path.iterdir()) == []  # nothing is written before fit


# ----------------------------------------------------------------- shared


def test_preempted_runs_are_marked(wandb_dir, tracking_uri):
    """A preemption (SIGTERM) ends both runs as interrupted, not failed."""

    class Preempt(px.Callback):
        @override
        def on_step_end(self, info):
            raise Preempted(signal.SIGTERM, None)

    loggers = [offline_logger(wandb_dir), MLflowLogger(tracking_uri=tracking_uri)]
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[*loggers, Preempt()]
    )
    with pytest.raises(Preempted):
        trainer.fit(batches(), epochs=1)
    [part] = wandb_parts(wandb_dir)
    assert part.get("preempting") and part["exit_code"] == 128 + signal.SIGTERM
    client = mlflow.MlflowClient(tracking_uri)
    assert client.get_run(loggers[1].run_id).info.status == "KILLED"


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def test_a_tracker_failure_is_a_tracker_error(tmp_path, wandb_dir, monkeypatch):
    """MLflow's or W&B's own error arrives as phalanx's TrackerError, theirs
    kept as the cause; no step is taken, and the other callbacks that had
    started (a CSV file open) are closed."""
    # MLflow retries an unanswered request for minutes by default.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://127.0.0.1:{closed_port()}"
    failing = {
        "mlflow": (
            lambda: MLflowLogger(tracking_uri=uri),
            mlflow.exceptions.MlflowException,
            f"MLflowLogger could not start its run at {uri} (MlflowException: API "
            "request to ",
        ),
        "wandb": (
            # A bad setting (W&B validates its settings with pydantic).
            lambda: WandbLogger(
                mode="offline", dir=str(wandb_dir), settings={"console": "bogus"}
            ),
            ValueError,
            "WandbLogger could not start its run (ValidationError: 1 validation "
            "error for Settings console Input should be 'auto', ",
        ),
    }
    for name, (make, cause, message) in failing.items():
        csv = CSVLogger(tmp_path / f"{name}.csv")
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), callbacks=[csv, make()]
        )
        with pytest.raises(TrackerError) as caught:
            trainer.fit(batches(), epochs=1)
        assert str(caught.value).startswith(message), caught.value
        assert "\n" not in str(caught.value)
        assert isinstance(caught.value.__cause__, cause)
        assert int(trainer.state.step) == 0
        assert csv._file is None  # closed: no ResourceWarning


@pytest.mark.parametrize(
    ("make", "module", "extra"),
    [(lambda: WandbLogger("p"), "wandb", "wandb"), (MLflowLogger, "mlflow", "mlflow")],
)
def test_missing_extra_is_named(monkeypatch, make, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'phalanx\[{extra}\]'"):
        make()


def test_hyperparameters_of_a_wrapping_strategy_and_chained_optimizer():
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)),
        strategy=px.AccumulatingStrategy(px.PmapStrategy(4), 2),
        precision="bf16",
        steps_per_call=2,
        nan_policy="skip",
    )
    params = hyperparameters(trainer)
    assert params == {
        "strategy": "AccumulatingStrategy",
        "strategy.inner": "PmapStrategy",
        "strategy.inner.axis_name": "data",
        "strategy.inner.deterministic": False,
        "strategy.microbatches": 2,
        "strategy.num_devices": 4,
        "precision": "bf16",
        "steps_per_call": 2,
        "nan_policy": "skip",
        "sync_every": 16,
        "model": "MLP",
        "model.parameters": TRAINER_PARAMS["model.parameters"],
        "optimizer_state": "TraceState",
    }


def test_evaluations_every_n_steps_are_logged_at_their_steps(wandb_dir, tracking_uri):
    """``fit(eval_every=3)`` with two named sets: each evaluation's metrics
    under ``eval/<set>_<metric>`` at its step, in both trackers."""
    loggers = [
        offline_logger(wandb_dir, id="evals"),
        MLflowLogger(tracking_uri=tracking_uri, log_every=LOG_EVERY),
    ]
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=loggers)
    sets = {"val": eval_batches(), "train": batches()[:2]}
    trainer.fit(batches(), epochs=EPOCHS, eval_data=sets, eval_every=3)
    evaluations = trainer.history.evaluations
    assert [e["step"] for e in evaluations] == [3, 6, 9, 12]
    expected = {
        f"eval/{name.removeprefix('eval_')}": [
            (e["step"], e[name]) for e in evaluations
        ]
        for name in ("eval_val_loss", "eval_val_accuracy", "eval_train_loss")
    }
    [part] = wandb_parts(wandb_dir)
    logged = {
        tag: [
            (step, row[tag]) for step, row in sorted(part["rows"].items()) if tag in row
        ]
        for tag in expected
    }
    assert logged == expected
    client = mlflow.MlflowClient(tracking_uri)
    history = mlflow_history(client, loggers[1].run_id)
    assert {tag: history[tag] for tag in expected} == expected
    assert "eval/loss" not in history  # the epochs' rows hold no evaluation
