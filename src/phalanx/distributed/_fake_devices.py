"""`fake_cpu_devices`: several CPU devices for JAX on a host without
accelerators, so data parallelism can run (and be tested) there. It only
configures JAX's CPU platform and ``NPROC`` before JAX starts its CPU backend;
it creates no array, and once the backend has started it can only say so."""

import os

import jax

from .._typing import validates_own_arguments
from .._validate import positive_int


@validates_own_arguments
def fake_cpu_devices(n: int = 8) -> None:
    """Expose `n` CPU devices to JAX, for data parallelism on a CPU-only host.

    Call it before JAX runs anything. It only changes the CPU platform, so on
    a host with accelerators JAX still uses those. It also sets ``NPROC`` to
    ``2 n`` unless the user set it: XLA:CPU's cross-device all-reduce can
    otherwise starve its thread pool and abort.

    Raises:
        ValueError: n is not a positive int.
        RuntimeError: JAX has already started its CPU backend.
    """
    positive_int("n", n, example="8")
    os.environ.setdefault("NPROC", str(2 * n))
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as error:
        raise RuntimeError(
            f"fake_cpu_devices({n}) must run before JAX creates any array; call "
            "it at the top of your script, right after the imports"
        ) from error
