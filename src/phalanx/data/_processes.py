"""Which slice of every global batch this process takes: the process index
and count a loader reads, checked against the global batch size. Only two
ints are read from JAX; loaders themselves never use it."""

from .._validate import integer


def process_layout(
    batch_size: int, process_index: int | None, process_count: int | None
) -> tuple[int, int]:
    """``(process_index, process_count)``, JAX's where not given, checked:
    the count divides `batch_size` (each process takes an equal slice).

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).
    """
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    integer(
        "process_count", process_count, minimum=1, numpy=True, example="process_count=1"
    )
    integer(
        "process_index",
        process_index,
        minimum=0,
        numpy=True,
        hint=f"an index in [0, {process_count}) for {process_count=}",
    )
    if process_index >= process_count:
        raise ValueError(
            f"{process_index=} is out of range for {process_count=}; pass an "
            f"index in [0, {process_count - 1}]"
        )
    if batch_size % process_count:
        raise ValueError(
            f"{batch_size=} is not divisible by {process_count=}: every process "
            "takes an equal slice of each global batch; use a multiple of "
            f"{process_count}, e.g. {_multiples(batch_size, process_count)}"
        )
    return process_index, process_count


def _multiples(batch_size: int, count: int) -> str:
    """Multiples of `count` on either side of `batch_size`, for a message."""
    below = batch_size // count * count
    sizes = [s for s in (below, below + count) if s > 0]
    return " or ".join(str(s) for s in sizes)
