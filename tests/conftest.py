import os


# Eight fake CPU devices on two cores: XLA:CPU's all-reduce needs a thread pool
# of at least twice the device count, set before JAX creates its CPU client
# (NOTES-jax-cpu trap 1).
os.environ.setdefault("NPROC", "16")

import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
# Not strict dtype promotion: optax's own adam (bias correction, `count ** ...`)
# fails under it with JAX 0.10 / optax 0.2.8.
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(5678), 1000))
    return lambda: next(keys)
