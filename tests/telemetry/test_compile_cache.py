"""``phalanx train``'s persistent compilation cache (_telemetry/_compile_cache.py):
a run writes its compiled programs into the folder and the next identical
run reads every one of them back; damaged entries, a file where the folder
should be and a folder that cannot be written are each said in one line,
and the run goes on without them; the start line shows the step's FLOPs.
Each run is tiny (one epoch of three steps)."""

import os
import pathlib
import subprocess
import sys

import pytest

import forkserver
from cli_runs import ENV, NOTICE, TIMEOUT, refused, said
from phalanx._telemetry._compile_cache import (
    _EntryWarnings,
    _unusable,
    compile_cache_dir,
)


TINY = ["--epochs", "1", "--batch-size", "512", "--no-plot", "--logger", "csv"]


def train(cwd: pathlib.Path, run: str, *args: str) -> subprocess.CompletedProcess:
    result = forkserver.run(
        [sys.executable, "-m", "phalanx", "train", *TINY, "--run-dir", run, *args],
        cwd=cwd,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def entries(folder: pathlib.Path) -> dict[str, int]:
    """The cache's entries and when each was written."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("*-cache")}


@pytest.mark.slow
def test_a_second_run_reads_every_program_and_damage_is_said_once(tmp_path):
    cache = tmp_path / "cache"
    first = train(tmp_path, "A", "--compile-cache", str(cache))
    assert said(first.stderr) == [NOTICE]
    start = first.stdout.splitlines()[1]
    assert start.endswith(
        "; 138 MFLOPs per step (17.3 MFLOPs per device) (no mfu: no peak FLOP/s "
        "known for 'cpu' devices)"
    ), start
    written = entries(cache)
    assert len(written) > 10  # the steps and the small programs around them

    second = train(tmp_path, "B", "--compile-cache", str(cache))
    assert said(second.stderr) == [NOTICE]
    assert entries(cache) == written  # every program read, none written again

    for path in cache.iterdir():
        path.write_bytes(b"garbage")
    (cache / "not-an-entry").write_text("junk")
    damaged = train(tmp_path, "C", "--compile-cache", str(cache))
    warning, notice = said(damaged.stderr)
    assert notice == NOTICE
    assert warning.startswith(f"phalanx: the compile cache {cache}: damaged or ")
    assert warning.endswith(
        "those programs are compiled afresh (delete the folder to clear it)"
    )


@pytest.mark.slow
def test_a_file_where_the_folder_should_be_is_said_and_left_alone(tmp_path):
    blocked = tmp_path / "cache"
    blocked.write_text("mine")
    result = train(tmp_path, "A", "--compile-cache", str(blocked))
    assert said(result.stderr) == [
        f"phalanx: the compile cache {blocked}: a file is where the folder should "
        "be; compiling without the cache (pass another folder, or "
        "--no-compile-cache)",
        NOTICE,
    ]
    assert blocked.read_text() == "mine"


def test_unusable_folders(tmp_path):
    (tmp_path / "file").write_text("")
    assert _unusable(tmp_path / "new" / "folder") is None
    assert (tmp_path / "new" / "folder").is_dir()
    assert _unusable(tmp_path / "file") == "a file is where the folder should be"
    below = _unusable(tmp_path / "file" / "below")
    assert below is not None and below.startswith("cannot write there")
    # Unwritable even for root (the tests may run as root: no chmod).
    proc = _unusable(pathlib.Path("/proc/phalanx-cache"))
    assert proc is not None and proc.startswith("cannot write")


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_dir(None, False) == tmp_path / "phalanx" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache_dir(None, False) == pathlib.Path.home() / ".cache/phalanx/jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    assert compile_cache_dir(None, False) == pathlib.Path("/somewhere")
    assert compile_cache_dir("~/mine", False) == pathlib.Path.home() / "mine"
    assert compile_cache_dir("mine", True) is None


def test_entry_warnings_are_said_once_and_others_passed_on(capsys):
    shown = []
    show = _EntryWarnings(pathlib.Path("/c"), lambda *args: shown.append(args[0]))
    for name in ("a", "b"):
        show(UserWarning(f"Error reading persistent compilation cache entry for "
                         f"'jit_{name}': bad"), UserWarning, "f.py", 1)  # fmt: skip
    show(UserWarning("something else"), UserWarning, "f.py", 1)
    assert capsys.readouterr().err == (
        "phalanx: the compile cache /c: damaged or unwritable entries (reading "
        "persistent compilation cache entry for 'jit_a': bad); those programs "
        "are compiled afresh (delete the folder to clear it)\n"
    )
    assert [str(w) for w in shown] == ["something else"]


def test_contradicting_flags_are_refused(tmp_path):
    line = refused(tmp_path, "train", "--compile-cache", "x", "--no-compile-cache")
    assert line == (
        "phalanx train: error: --compile-cache x and --no-compile-cache contradict "
        "each other; pass one"
    )
    assert not os.listdir(tmp_path)
