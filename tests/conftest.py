import atexit
import compileall
import gc
import json
import os
import pathlib
import sys
import tempfile


# Eight fake CPU devices on two cores: XLA:CPU's all-reduce needs a thread pool
# of at least twice the device count, set before JAX creates its CPU client
# ("JAX on CPU" in docs/architecture.md).
os.environ.setdefault("NPROC", "16")
# Tests are bound by XLA:CPU's compile time, not by the speed of the code it
# makes: without LLVM's optimisations a step compiles 2-3x faster (Equinox's
# BERT example: 85 -> 37 s for assert_equivalent's four set-ups). Set in the
# environment, so the CLI and multi-process runs the tests start inherit it;
# the README's main job, timed as a user runs it, drops it. XLA:CPU's newer
# fusion emitters (MLIR) compile a step ~2x slower than its older ones, which
# make the same programs: off too (an MLP's steps under four strategies:
# 5.0 -> 2.5 s of backend compile).
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}"

# Tests, and the CLI and multi-process runs they start, build many trainers
# whose steps compile to the same programs: one persistent compilation cache
# for the session compiles each program once. The first process to load this
# file (pytest's controller, before its workers start) makes it and passes it
# on in the environment, with the others' settings; a size limit turns on the
# cache's file lock, so that no process reads an entry another is still
# writing. Removed when that process ends.
# The bytecode of phalanx and of the tests' shared modules, written once: with
# PYTHONDONTWRITEBYTECODE set (as in some sandboxes and CI images) no import
# writes it, and each of the ~170 processes the suite starts (CLI runs,
# launches, doc pages) would compile ~120 modules from source again (~0.35 s
# of CPU each). Python reads existing bytecode whatever the setting.
if sys.dont_write_bytecode and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _ROOT = pathlib.Path(__file__).resolve().parent.parent
    for _folder in (_ROOT / "src" / "phalanx", _ROOT / "tests"):
        compileall.compile_dir(_folder, quiet=2)

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.TemporaryDirectory(prefix="phalanx-test-xla-cache-")
    atexit.register(_XLA_CACHE.cleanup)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE.name
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 * 2**30)

# Python's automatic garbage collector, rarer in the test processes: tracing
# and lowering make millions of short-lived objects, and each full
# collection walks every live one (JAX's caches, the jaxprs kept), ~0.3 s
# apiece here. With the default thresholds (700, 10, 10) a process tracing
# the planner's candidates (tests/plan) spent 10 s of its 70 in collections,
# one checking every eqx.nn layer (test_eqx_layers.py) 7 of 40; with these,
# 2-3 s and 1.6 s. Garbage is still collected (young cycles every million
# allocations, each fit's own collections); only how often changes, which
# nothing the tests check depends on (a fit's `gc=` policy sets and restores
# its own; tests/telemetry/test_gc.py reads whatever it finds). The CLI and
# script runs the tests start keep Python's defaults, as a user's do.
gc.set_threshold(50_000, 20, 10)

import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
# Not strict dtype promotion: optax's own adam (bias correction, `count ** ...`)
# fails under it with JAX 0.10 / optax 0.2.8.
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


# --- the order xdist hands out test files ------------------------------------
#
# `--dist loadfile` sends whole files to the workers, by default the files
# with the most tests first: a file of a few long tests went last, and one
# worker ran on with it while the others had finished. Longest first
# instead (LPT), by the seconds each file took in a suite run here
# (file_seconds.json: the --durations=0 times of a run, summed per file and
# scaled to a quiet machine's). A file the table does not name is new and
# unmeasured, so it goes first: a long one started last would be the tail,
# a short one started first costs nothing. Refresh the table when files
# are renamed or change much. Only the order changes: what runs, and which
# tests run together in one worker, stay as they were.
FILE_SECONDS: dict[str, float] = json.loads(
    (pathlib.Path(__file__).with_name("file_seconds.json")).read_text()
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            def seconds(item):
                path, _ = item
                return -FILE_SECONDS.get(path, float("inf"))

            ordered = sorted(self.workqueue.items(), key=seconds)  # stable
            self.workqueue.clear()
            self.workqueue.update(ordered)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(5678), 1000))
    return lambda: next(keys)


# --- the CLI runs of test_resume_cli.py and test_faults.py, shared -------------

from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
from typing_extensions import override  # noqa: E402

import phalanx as px  # noqa: E402
from cli_runs import (  # noqa: E402
    COMMON,
    EPOCHS,
    EVERY_5,
    FINAL,
    NOTICE,
    STALE_TMP,
    TOTAL,
    cli_trainer,
    finish,
    said,
    state_arrays,
)


@pytest.fixture(scope="session")
def reference_run() -> tuple[dict[int, list[np.ndarray]], list[dict]]:
    """The CLI's training, in this process: step -> the full state after it,
    and the history (no eval data, no throughput)."""
    states: dict[int, list[np.ndarray]] = {}

    class Record(px.Callback):
        @override
        def on_step_end(self, info):
            states[info.step] = state_arrays(info.trainer)

    trainer, loader = cli_trainer([Record()])
    trainer.fit(loader, epochs=EPOCHS)
    assert sorted(states) == list(range(1, TOTAL + 1))
    return states, trainer.history.epochs


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[int, list[np.ndarray]]:
    return reference_run[0]


@pytest.fixture(scope="session")
def restore() -> Callable[[pathlib.Path, int], list[np.ndarray]]:
    """Reads checkpoint `folder/step` into a trainer built as the CLI builds
    it; returns its state arrays."""
    trainer, _ = cli_trainer()

    def read(folder: pathlib.Path, step: int) -> list[np.ndarray]:
        checkpoint = px.callbacks.Checkpoint(folder, every_n_epochs=None)
        checkpoint.restore(trainer, folder / str(step), None)
        assert int(trainer.state.step) == step
        return state_arrays(trainer)

    return read


@pytest.fixture(scope="session")
def straight(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """A run that is never stopped: its folder and its last stdout line."""
    cwd = tmp_path_factory.mktemp("straight")
    run = finish(cwd, *COMMON, *EVERY_5, "--run-dir", "RUN")
    # orbax may note, from its own finalizing thread under load, that the
    # temporary folder of the save it is writing has no metadata yet (seen
    # once in CI): its own folder, nothing a killed run left.
    lines = [line for line in said(run.stderr) if not STALE_TMP.fullmatch(line)]
    assert lines == [NOTICE], run.output()
    assert FINAL.match(run.lines[-1]), run.output()
    return cwd / "RUN", run.lines[-1]
