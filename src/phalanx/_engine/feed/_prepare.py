"""The first program of all, built from a user's first batch: the batch
split and looked at by the pipeline, the program built by the programs and
checked against the model and loss abstractly, so that a batch that does
not fit is refused before anything is placed or compiled."""

from typing import Any

from ..._checks._hooks import HookError
from ..program._program import Program
from ..program._programs import Programs
from ._labels import label_shape_hint
from ._pipeline import BatchPipeline


def first_program(
    pipeline: BatchPipeline,
    programs: Programs,
    batch: Any,
    where: str,
    *,
    compile: bool = True,
) -> Program:
    """The program for a user's first `batch`, kept in `programs`; the
    batch's spec is every later batch's. (``compile=False``: see
    `build_program`.)

    Raises:
        TypeError, ValueError: the batch does not fit the model or loss (with
            class labels, a hint where the labels' shape is the cause).
    """
    first = pipeline.first_batch(batch, where)
    try:
        return programs.build(first.spec, first.size, compile=compile)
    except HookError:
        raise  # a hook's own fault, named by its message
    except (TypeError, ValueError) as error:
        hint = label_shape_hint(first.labels) if pipeline.class_labels else None
        if hint is None:
            raise
        raise TypeError(hint) from error
