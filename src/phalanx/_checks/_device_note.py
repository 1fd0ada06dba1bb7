"""The one line a CPU-only host gets when the Python API trains there.

JAX shows a CPU-only host as one device unless told to fake more, so a
`fit` there trains on one device without data parallelism, where the CLI
(which fakes 8) would use eight. The first such `fit` of a process says so
once on phalanx's logger (stderr), with how to fake more. Nothing is said
where the devices were faked (``px.fake_cpu_devices``, even to one), on
accelerators, or where JAX sees several devices (several processes'
included). It only reads JAX's configuration; it changes nothing.
"""

import jax

from .._log import logger


_said = False


def devices_said() -> None:
    """Keep the note unsaid: the caller (``phalanx train``) tells the user
    itself which devices it trains on."""
    global _said
    _said = True


def note_single_cpu_device(num_devices: int) -> None:
    """Say once per process that training runs on JAX's single CPU device,
    when a strategy of `num_devices` devices runs there because JAX sees no
    other."""
    global _said
    if _said or num_devices != 1:
        return
    faked = jax.config.jax_num_cpu_devices > 0  # pyright: ignore[reportAttributeAccessIssue]
    if faked or jax.default_backend() != "cpu" or jax.device_count() != 1:
        return
    _said = True
    logger.info(
        "training on 1 CPU device: JAX sees no accelerator and only one CPU "
        "device. To train data-parallel on this host's cores (as `phalanx train` "
        "does), call px.fake_cpu_devices(8) at the top of the script, before JAX "
        "starts"
    )
