"""JAX's persistent compilation cache for ``phalanx train`` and ``phalanx
find-lr``: where it lives, checked before JAX compiles anything.

A run compiles the same programs as the run before it (the train, eval and
predict steps, the small programs that place and copy arrays); with the
cache a second run reads them from disk instead of compiling them again.
The folder is ``--compile-cache DIR``, else ``$JAX_COMPILATION_CACHE_DIR``
where it is set (JAX reads it itself), else ``phalanx/jax`` under the
user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``);
``--no-compile-cache`` turns it off. A folder that cannot be used (a file
where it should be, no permission to write) is left alone with one warning
line and the run compiles without it; damaged entries inside it (JAX
compiles those programs again, and warns once per entry) are said in one
line too. Nothing here runs before the arguments are checked; JAX is
imported only by `use_compile_cache`.
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, TextIO


def compile_cache_dir(option: str | None, off: bool) -> Path | None:
    """The folder of the cache a run uses (None: none), from
    ``--compile-cache`` (`option`), ``--no-compile-cache`` (`off`) and the
    environment."""
    if off:
        return None
    if option is not None:
        return Path(option).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "phalanx" / "jax"


def use_compile_cache(option: str | None, off: bool) -> Path | None:
    """Turn JAX's persistent compilation cache on in its folder (see
    `compile_cache_dir`), or off; before JAX compiles anything. Returns the
    folder, or None where the cache is off or its folder unusable (said in
    one line on stderr)."""
    import jax

    folder = compile_cache_dir(option, off)
    problem = None if folder is None else _unusable(folder)
    if folder is None or problem is not None:
        if problem is not None:
            print(
                f"phalanx: the compile cache {folder}: {problem}; compiling without "
                "the cache (pass another folder, or --no-compile-cache)",
                file=sys.stderr,
            )
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX keeps only programs that took 1 s or more to compile; a run's
        # many quicker ones add up (on a CPU, most of a small run's time).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    warnings.showwarning = _EntryWarnings(folder, warnings.showwarning)
    return folder


class _EntryWarnings:
    """`warnings.showwarning` that says JAX's warnings about cache entries
    it cannot read or write (jax/_src/compiler.py: one per entry, with a
    traceback line) once, in one line, and passes every other warning on."""

    PREFIXES = (
        "Error reading persistent compilation cache entry",
        "Error writing persistent compilation cache entry",
    )

    def __init__(self, folder: Path, show: Any):
        self.folder = folder
        self.show = show
        self.said = False

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if not text.startswith(self.PREFIXES):
            self.show(message, category, filename, lineno, file, line)
        elif not self.said:
            self.said = True
            print(
                f"phalanx: the compile cache {self.folder}: damaged or unwritable "
                f"entries ({text.removeprefix('Error ')}); those programs are "
                "compiled afresh (delete the folder to clear it)",
                file=sys.stderr,
            )


def _unusable(folder: Path) -> str | None:
    """Why `folder` cannot hold the cache (made where missing), or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except FileExistsError:
        return "a file is where the folder should be"
    except OSError as error:
        return f"cannot write there ({error.strerror or error})"
    return None
