"""``phalanx launch`` and ``phalanx.distributed.initialize`` with real
processes on 127.0.0.1 (gloo collectives between processes)."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cli_runs import said
from helpers import is_gloo_note
from phalanx.cli._gloo_notes import GlooNotes
from phalanx.cli._main import main
from phalanx.cli._ranks import free_port


ENV = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
ENV |= {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
# A user's XLA flags left out (a fake device count would change what launch
# sets up); the tests' compiler setting (conftest.py) kept: these runs test
# processes, not compiled code, and compile ~2x faster with it.
ENV["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
ENV.pop("NPROC", None)


def launch(
    *args: str, script: str, timeout: float = 120, env: dict[str, str] = ENV
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "phalanx", "launch", *args]
    command += ["--", sys.executable, "-c", textwrap.dedent(script)]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout
    )


def lines_of(output: str, rank: int) -> list[str]:
    """Rank `rank`'s lines, less gloo's connection notes."""
    prefix = f"[{rank}] "
    return [
        line[len(prefix) :]
        for line in output.splitlines()
        if line.startswith(prefix) and not is_gloo_note(line)
    ]


def test_two_processes_form_one_run_of_four_devices():
    done = launch(
        "--nproc",
        "2",
        "--devices-per-process",
        "2",
        script="""
        import phalanx as px
        px.distributed.initialize()
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        local = np.full((2, 3), jax.process_index() + 1.0, np.float32)
        split = NamedSharding(mesh, P("data"))
        x = jax.make_array_from_process_local_data(split, local)
        print(jax.process_index(), jax.process_count(), jax.device_count(),
              float(jax.jit(jnp.sum)(x)))
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        # Exactly once; gloo's C++ notes share the pipe and can leave a stray
        # fragment of theirs on a rank's line (seen once: "[0] 3").
        assert lines_of(done.stdout, rank).count(f"{rank} 2 4 18.0") == 1, done.stdout
    # launch keeps gloo's connection notes out of the output (--verbose keeps them).
    assert "[Gloo]" not in done.stdout + done.stderr


GLOO = (
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected "
    "peer ranks is : 1"
)


@pytest.mark.parametrize(
    ("lines", "kept"),
    [
        ([GLOO + "\n", "out\n"], ["out\n"]),
        # cut by another writer's line end: its rest starts the next lines
        ([GLOO[:-1] + "\n", "1\n", "\n", "out\n"], ["out\n"]),
        ([GLOO[:40] + "\n", GLOO[40:] + "\n", "\n", "\n"], ["\n"]),
        # the program's text on the note's line is kept
        ([GLOO[:20] + "out\n"], ["out\n"]),
        (["x " + GLOO + " y\n"], ["x  y\n"]),
        # not a note: kept as written
        (["1\n", "\n", "[1] ranks\n"], ["1\n", "\n", "[1] ranks\n"]),
    ],
)
def test_gloo_notes_are_taken_out_of_the_lines(lines, kept):
    notes = GlooNotes()
    assert [line for line in map(notes, lines) if line is not None] == kept


def test_a_dead_rank_stops_the_others():
    start = time.monotonic()
    done = launch(
        "--nproc",
        "3",
        script="""
        import os, signal, time
        if os.environ["JAX_PROCESS_ID"] == "1":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        print("waiting", flush=True)
        time.sleep(600)
        """,
    )
    assert time.monotonic() - start < 60
    assert done.returncode == 128 + 9
    assert (
        "rank 1 was killed by SIGKILL; the other processes were stopped" in done.stderr
    )
    assert lines_of(done.stdout, 0) == lines_of(done.stdout, 2) == ["waiting"]


@pytest.mark.parametrize(
    "dies, then, code, named",
    [
        # Rank 0 fails as a peer does on the broken connection, and its exit
        # is seen even before rank 1's death by SIGKILL (50 ms later here;
        # the waiters' threads may see them in either order): the launcher
        # names the rank SIGKILL killed, within SETTLE of the first failure.
        (
            "time.sleep(0.05); os.kill(os.getpid(), signal.SIGKILL)",
            "os._exit(1)",
            128 + 9,
            "rank 1 was killed by SIGKILL",
        ),
        # Rank 0 hangs: its watchdog dumps and exits (75); JAX's coordination
        # service, which it hosted, aborts rank 1 at once (SIGABRT), and a
        # large process takes a while to end, so rank 1's death may be seen
        # first (500 ms here: past SETTLE, within HANG_SETTLE, and after the
        # launcher's SIGTERM, which a process already exiting no longer
        # heeds: rank 0 ignores it). The launcher names the hung rank, not
        # the peer its exit aborted.
        (
            "os.kill(os.getpid(), signal.SIGABRT)",
            "time.sleep(0.5); os._exit(75)",
            75,
            "rank 0 was ended by its hang watchdog",
        ),
    ],
    ids=["killed", "hung"],
)
def test_the_rank_to_blame_is_named_not_the_peers_it_ended(
    tmp_path, dies, then, code, named
):
    marker = tmp_path / "dead"
    done = launch(
        "--nproc",
        "2",
        script=f"""
        import os, signal, sys, time
        marker = {str(marker)!r}
        if os.environ["JAX_PROCESS_ID"] == "1":
            time.sleep(0.5)
            open(marker, "w").close()
            {dies}
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while not os.path.exists(marker):
            time.sleep(0.001)
        {then}
        """,
    )
    assert done.returncode == code, done.stderr
    assert named in done.stderr


def test_max_restarts_starts_every_rank_again_after_a_failure():
    # Rank 1 fails in the first two starts (exit 3, then as the hang
    # watchdog exits), rank 0 waits; the third start ends well.
    done = launch(
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        script="""
        import os, sys, time
        restart = os.environ["PHALANX_RESTART_COUNT"]
        rank = os.environ["JAX_PROCESS_ID"]
        cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
        print(restart, os.environ["JAX_COORDINATOR_ADDRESS"], cache, flush=True)
        assert os.path.isdir(cache)
        if restart != "2":
            if rank == "1":
                time.sleep(0.3)
                sys.exit(3 if restart == "0" else 75)
            time.sleep(600)
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    starts = [line.split() for line in lines_of(done.stdout, 1)]
    assert [start[0] for start in starts] == ["0", "1", "2"]
    assert len({start[1] for start in starts}) == 3  # a fresh port each time
    (cache,) = {start[2] for start in starts}  # one compile cache for all
    assert not os.path.exists(cache)  # the launcher's own, removed at the end
    notes = [line for line in done.stderr.splitlines() if "restart " in line]
    assert len(notes) == 2
    assert notes[0].startswith("phalanx launch: rank 1 exited with code 3 ")
    assert notes[0].endswith("restart 1/2 of all 2 processes")
    assert notes[1].startswith(
        "phalanx launch: rank 1 was ended by its hang watchdog (exit code 75) "
    )


def test_max_restarts_gives_up_after_n_and_keeps_a_cache_the_user_set(tmp_path):
    done = launch(
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        script=f"""
        import os, sys
        assert os.environ["JAX_COMPILATION_CACHE_DIR"] == {str(tmp_path)!r}
        sys.exit(int(os.environ["JAX_PROCESS_ID"]) * 5)
        """,
        env=ENV | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)},
    )
    assert done.returncode == 5, done.stderr
    assert "restart 1/1" in done.stderr and "restart 2/" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "phalanx launch: rank 1 exited with code 5; the other processes were "
        "stopped (after 1 restarts)"
    )
    assert tmp_path.is_dir()


@pytest.mark.parametrize(
    ("given", "seen"),
    [(["--hang-timeout", "30"], "30"), ([], None), (["--hang-timeout", "off"], "off")],
)
def test_hang_timeout_reaches_every_process(given, seen):
    done = launch(
        "--nproc",
        "2",
        *given,
        script="""
        import os
        print("timeout", os.environ.get("PHALANX_HANG_TIMEOUT"))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert lines_of(done.stdout, 0) == lines_of(done.stdout, 1) == [f"timeout {seen}"]


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_bad_max_restarts_is_refused_in_one_line(value):
    done = launch("--nproc", "2", "--max-restarts", value, script="pass")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "phalanx launch: error: argument --max-restarts: must be a whole number, "
        f"0 or more, got {value!r} (see phalanx launch --help)"
    ]


def test_signals_reach_every_rank():
    script = """
import os, signal, sys, time
def stop(signum, frame):
    print("rank", os.environ["JAX_PROCESS_ID"], "got", signum, flush=True)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(600)
"""
    command = [sys.executable, "-m", "phalanx", "launch", "--nproc", "2", "--"]
    launcher = subprocess.Popen(
        [*command, sys.executable, "-c", script],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    ready = 0
    while ready < 2:
        ready += "ready" in launcher.stdout.readline()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143, out + err
    assert sorted(lines_of(out, 0) + lines_of(out, 1)) == [
        "rank 0 got 15",
        "rank 1 got 15",
    ]
    assert "stopping" not in err and "were stopped" not in err  # expected exits


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its reaper, as
    an orphan may be where PID 1 does not reap, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl: Linux")
def test_ranks_die_with_a_killed_launcher():
    # Each rank ignores SIGTERM and runs in its own session: only the death
    # signal the launcher set up can end it.
    script = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("pid", os.getpid(), flush=True)
time.sleep(600)
"""
    command = [sys.executable, "-m", "phalanx", "launch", "--nproc", "3", "--"]
    launcher = subprocess.Popen(
        [*command, sys.executable, "-c", script],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert launcher.stdout is not None
    pids: list[int] = []
    try:
        while len(pids) < 3:
            line = launcher.stdout.readline()
            assert line, f"the launcher ended first (code {launcher.wait()})"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 5
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if alive(pid)], "ranks outlived launch"
    finally:
        launcher.kill()
        launcher.wait(10)
        launcher.stdout.close()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_failing_rank_gives_its_exit_code():
    done = launch(
        "--nproc",
        "2",
        script="""
        import os, sys
        sys.exit(3 if os.environ["JAX_PROCESS_ID"] == "0" else 0)
        """,
    )
    assert done.returncode == 3
    assert "rank 0 exited with code 3" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0", "--", "true"], "--nproc: must be a positive integer"),
        (["--nproc", "2"], "launch needs a command after --"),
    ],
)
def test_bad_launch_arguments(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize("value", ["70000", "0", "-1", "http"])
def test_a_port_out_of_range_is_refused_in_one_line(value, capsys):
    # Issue 54, item 3: --port 70000 exited 0. Parsed in this process: no
    # process is started.
    with pytest.raises(SystemExit) as exited:
        main(["launch", "--nproc", "2", "--port", value, "--", "true"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "phalanx launch: error: argument --port: must be a TCP port from 1 to "
        f"65535, got {value!r}; leave --port out for a free one (see phalanx "
        "launch --help)"
    ]


def run_python(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=ENV | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_initialize_in_one_process_is_a_no_op():
    done = run_python(
        """
        import phalanx as px
        px.distributed.initialize()
        px.distributed.initialize(num_processes=1)
        import jax
        print(jax.process_count(), jax.device_count())
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_initialize_errors():
    start = time.monotonic()
    # Process 1 of 2; nobody listens at the coordinator's port.
    done = run_python(
        """
        import phalanx as px
        px.distributed.initialize(timeout=3)
        """,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="1",
    )
    assert time.monotonic() - start < 60
    assert done.returncode == 1
    assert "process 1 of 2 could not reach the coordinator at 127.0.0.1:" in done.stderr
    late = run_python(
        """
        import jax, phalanx as px
        jax.numpy.zeros(1)
        px.distributed.initialize("127.0.0.1:1234", 2, 0)
        """
    )
    assert "must run before JAX computes anything" in late.stderr
    partial = run_python(
        """
        import phalanx as px
        px.distributed.initialize(num_processes=2)
        """
    )
    assert "needs coordinator_address (or JAX_COORDINATOR_ADDRESS), process_id" in (
        partial.stderr
    )


def test_train_distributed_without_a_run(tmp_path):
    # --distributed with nothing to join trains here, and says so.
    def train(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "phalanx", "train", "--distributed", *args],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = train("--epochs", "1", "--run-dir", "run")
    assert done.returncode == 0, done.stderr
    assert said(done.stderr) == [
        "phalanx: --distributed, but no multi-process run was found "
        "(JAX_COORDINATOR_ADDRESS unset, no cluster detected); training in this "
        "process only"
    ]
    assert "on 1 cpu device(s)" in done.stdout.splitlines()[0]
    refused = train("--devices", "2", "--run-dir", "other")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "--devices chooses" in refused.stderr
    assert not (tmp_path / "other").exists()


def test_a_restarted_phalanx_train_goes_on_in_its_run_folder(tmp_path, monkeypatch):
    from phalanx.cli._config import restarted
    from phalanx.cli._parser import build_parser

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHALANX_LAUNCH_STAMP", "20260101-000000")
    run = str(pathlib.Path("runs") / "20260101-000000")

    def argv_of(*args: str) -> list[str]:
        argv = ["train", "--epochs", "2", *args]
        return restarted(argv, build_parser().parse_args(argv))[3:]

    monkeypatch.setenv("PHALANX_RESTART_COUNT", "0")  # a first start: as given
    assert argv_of() == []
    monkeypatch.setenv("PHALANX_RESTART_COUNT", "1")
    assert argv_of() == []  # the start before made no folder: as given
    (tmp_path / run / "checkpoints").mkdir(parents=True)
    assert argv_of() == ["--overwrite", "--run-dir", run]  # no checkpoint yet
    (tmp_path / run / "checkpoints" / "10").mkdir()
    assert argv_of() == ["--resume", "--run-dir", run]
    assert argv_of("--run-dir", "other") == ["--run-dir", "other"]  # none there
    for given in (["--resume"], ["--overwrite"], ["--config", "c.toml"]):
        assert argv_of(*given) == given  # the command says what it wants
