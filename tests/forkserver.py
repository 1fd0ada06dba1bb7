"""A fork server for the tests' command-line and script runs.

Each ``python -m phalanx ...`` a test starts spends ~3.5 s of CPU importing
JAX, Equinox, Optax, orbax and matplotlib before it does anything; the
suite's ~150 such runs spent a quarter of its CPU time there. The server
imports them once, without starting JAX's backend (each run still chooses
its own device count and thread pools), and forks a child per run: the
child starts where a fresh interpreter would be after those imports, takes
its own arguments, folder, environment and standard streams, runs the
module or script as ``__main__`` and exits as the interpreter would (its
exit code, ``-signal`` when killed, atexit handlers run).

`Popen` and `run` stand in for `subprocess`'s for ``[sys.executable, "-m",
module, ...]`` and ``[sys.executable, script, ...]``. A run whose environment
differs from the server's in a variable read while importing (``JAX_*``,
``PYTHON*`` but ``PYTHONUNBUFFERED``, ``XLA_PYTHON_*``; ``JAX_PLATFORMS``
each child sets again) gets a real
interpreter instead, as does any other command. Tests of what an
interpreter prints or imports as it starts (a plain install, ``--help``
importing no JAX) keep calling `subprocess` themselves.

One server per test process, started on first use with that process's
environment; it ends when that process does.
"""

import atexit
import json
import os
import pathlib
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from typing import Any


# What a ``phalanx train`` run imports (the server never starts JAX's
# backend: importing does not).
PRELOAD = (
    "jax",
    "jax.numpy",
    "jax.experimental.multihost_utils",
    "equinox",
    "optax",
    "orbax.checkpoint",
    "rich",
    "phalanx",
    "phalanx.cli._folder",
    "phalanx.cli._model",
    "phalanx.cli._outputs",
    "phalanx.cli._start",
    "phalanx.cli._train",
    "phalanx.data",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)


# JAX options read from the environment at import and used only when the
# backend starts: each child sets them again from its own environment.
_SET_AGAIN = {
    "JAX_PLATFORMS": ("jax_platforms", lambda value: value),
    "JAX_NUM_CPU_DEVICES": ("jax_num_cpu_devices", lambda value: int(value)),
}


def _read_at_import(name: str) -> bool:
    """Whether an environment variable may be read while the modules above
    are imported (a run must then have the server's value)."""
    if name == "PYTHONUNBUFFERED":  # how often output is flushed, not what
        return False
    if name in _SET_AGAIN:
        return False
    return name.startswith(("JAX_", "PYTHON", "XLA_PYTHON_", "TF_CPP_"))


# --- the server -------------------------------------------------------------


class _Job:
    """What a forked child runs: a module or a script, as ``__main__``."""

    def __init__(self, request: dict[str, Any]):
        self.request = request

    def run(self) -> None:
        request = self.request
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # JAX read these while the server imported it; no backend has started.
        import jax

        for variable, (option, parse) in _SET_AGAIN.items():
            value = os.environ.get(variable)
            if value is not None:
                jax.config.update(option, parse(value))
            elif option == "jax_platforms":
                jax.config.update(option, None)
            else:
                jax.config.update(option, -1)
        # What importing printed, as a fresh interpreter would have.
        sys.stdout.write(request["preload_out"])
        sys.stderr.write(request["preload_err"])
        if request["code"] is not None:
            sys.argv = ["-c", *request["args"]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")  # the code's globals, as
            sys.modules["__main__"] = main  # classes defined there look up
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
            return
        if request["module"] is not None:
            sys.argv = [request["module"], *request["args"]]
            sys.path[0] = os.getcwd()  # as `python -m` puts the folder first
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            script = str(pathlib.Path(request["script"]).resolve())
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")


def serve(address: str) -> _Job:
    """Import, then fork a child per request on `address` until stdin
    closes. Returns only in a child, with the job it is to run."""
    printed = []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            for name in PRELOAD:
                __import__(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        for file in (out, err):
            file.seek(0)
            printed.append(file.read())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    running: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":  # the test process ended
                for pid in running:
                    _kill(pid)
                raise SystemExit(0)
            if key.data == "child":
                os.read(wake_read, 4096)
                _reap(running)
                continue
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            request = json.loads(message)
            request["preload_out"], request["preload_err"] = printed
            pid = os.fork()
            if pid == 0:
                # The child: the server's sockets, pipes and handlers are
                # not its own.
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                listener.close()
                connection.close()
                for other in running.values():
                    other.close()
                os.close(wake_read)
                os.close(wake_write)
                for target, fd in zip((0, 1, 2), fds, strict=True):
                    os.dup2(fd, target)
                    os.close(fd)
                return _Job(request)
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
            _reap(running)


def _reap(running: dict[int, socket.socket]) -> None:
    """Tell each finished child's client its exit code."""
    for pid in list(running):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            connection = running.pop(pid)
            try:
                connection.sendall(f"{code}\n".encode())
            except OSError:
                pass
            connection.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the client -------------------------------------------------------------


class _Server:
    """This process's server, started on first use."""

    _lock = threading.Lock()
    _instance: "_Server | None" = None

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="phalanx-forkserver-")
        self.address = os.path.join(self.folder.name, "socket")
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line != "ready\n":
            raise RuntimeError(f"the fork server did not start: {line!r}")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "_Server":
        with cls._lock:
            if cls._instance is None or cls._instance.process.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def accepts(self, env: dict[str, str]) -> bool:
        names = {*env, *self.env}
        return all(
            env.get(name) == self.env.get(name)
            for name in names
            if _read_at_import(name)
        )

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the server kills what still runs
            self.process.wait(30)
        self.folder.cleanup()


def _what(command: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, what, args) of ``python -m MODULE ARGS`` ("-m"), ``python -c
    CODE ARGS`` ("-c") or ``python SCRIPT ARGS`` ("script"); None for any
    other command."""
    if not command or command[0] != sys.executable or len(command) < 2:
        return None
    if command[1] in ("-m", "-c") and len(command) >= 3:
        return command[1], command[2], list(command[3:])
    if command[1].startswith("-"):
        return None
    return "script", command[1], list(command[2:])


class Popen:
    """`subprocess.Popen` for a run the fork server can start (see the
    module's docstring), else a `subprocess.Popen`: ``pid``, ``stdout``
    (with ``stdout=subprocess.PIPE``), ``poll``, ``wait``, ``kill``,
    ``send_signal`` and ``returncode``, text mode only."""

    def __init__(
        self,
        command: list[str],
        *,
        cwd: str | os.PathLike[str],
        env: dict[str, str],
        stdout: Any = None,
        stderr: Any = None,
    ):
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stderr: Any = None
        self._fallback: subprocess.Popen[str] | None = None
        what = _what([str(part) for part in command])
        server = _Server.get() if what is not None else None
        if what is None or server is None or not server.accepts(env):
            self._fallback = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True
            )
            self.pid = self._fallback.pid
            self.stdout, self.stderr = self._fallback.stdout, self._fallback.stderr
            return
        kind, target, args = what
        fds, keep = [os.open(os.devnull, os.O_RDONLY)], []
        for stream, name in ((stdout, "stdout"), (stderr, "stderr")):
            if stream == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, name, open(read, encoding="utf-8", errors="replace"))
                fds.append(write)
            elif stream is None:
                fds.append(os.dup(1 if name == "stdout" else 2))
            else:
                fds.append(os.dup(stream.fileno()))
            keep.append(fds[-1])
        request = {
            "module": target if kind == "-m" else None,
            "code": target if kind == "-c" else None,
            "script": target if kind == "script" else None,
            "args": args,
            "cwd": str(cwd),
            "env": env,
        }
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(server.address)
        socket.send_fds(self._connection, [json.dumps(request).encode()], fds)
        for fd in fds:
            os.close(fd)
        self._replies = self._connection.makefile("r")
        self.pid = int(self._replies.readline())
        self._waiter = threading.Thread(target=self._wait_for_exit, daemon=True)
        self._done = threading.Event()
        self._waiter.start()

    def _wait_for_exit(self) -> None:
        line = self._replies.readline()
        self.returncode = int(line) if line else -signal.SIGKILL
        self._connection.close()
        self._done.set()

    def poll(self) -> int | None:
        if self._fallback is not None:
            self.returncode = self._fallback.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._fallback is not None:
            self.returncode = self._fallback.wait(timeout)
            return self.returncode
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(["forkserver", str(self.pid)], timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end (at once, so that neither fills),
        then the exit awaited."""
        results: dict[str, str] = {}

        def drain(name: str) -> None:
            stream = getattr(self, name)
            results[name] = "" if stream is None else stream.read()

        readers = [
            threading.Thread(target=drain, args=(name,), daemon=True)
            for name in ("stdout", "stderr")
        ]
        for reader in readers:
            reader.start()
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)
            raise
        for reader in readers:
            reader.join(timeout)
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                stream.close()
        return results.get("stdout", ""), results.get("stderr", "")


def run(
    command: list[str],
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True, ...)`, the
    run started by the fork server where it can be."""
    process = Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = process.communicate(timeout)
    assert process.returncode is not None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


if __name__ == "__main__":
    # The server; `serve` returns only in a forked child, which then runs
    # its job here, at the top, as a fresh interpreter runs its main module.
    _Job.run(serve(sys.argv[1]))
