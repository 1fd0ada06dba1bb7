"""The curves `PlotHistory` draws from a `History`: which metrics have an
evaluation beside them, and each curve's points against epochs or steps.
It reads the history only; it draws nothing.
"""

from .._state._history import History


def eval_names(history: History) -> list[str]:
    """The history's eval metrics: the epochs' and the evaluations'."""
    arrays = set(history.names) - set(history.scalar_names)
    names = [*history.names, *(k for e in history.evaluations for k in e)]
    return list(
        dict.fromkeys(k for k in names if k.startswith("eval_") and k not in arrays)
    )


def is_eval_of(eval_name: str, metric: str) -> bool:
    """Whether `eval_name` is `metric` evaluated: ``eval_<metric>``, or
    ``eval_<set>_<metric>`` for a named set."""
    return eval_name == f"eval_{metric}" or (
        eval_name.startswith("eval_") and eval_name.endswith(f"_{metric}")
    )


def evaluated_between_epochs(history: History) -> bool:
    """Whether fit evaluated every N steps (metrics the epochs lack): then
    the curves are drawn against steps."""
    present = set(history.names)
    return any(
        name.startswith("eval_") and name not in present
        for evaluation in history.evaluations
        for name in evaluation
    )


def curves(
    history: History, name: str, *, by_step: bool
) -> list[tuple[str, list[float], list[float]]]:
    """A panel's curves (label, x, y): the train metric `name` over epochs
    (by step: at the steps they ended), and each set's evaluation of it."""
    curves = []
    epochs = [float(e) for e in range(1, len(history) + 1)]
    if name in history.names:
        pairs = zip(history.steps, history[name], strict=True)
        if by_step:  # (an epoch recorded by an earlier version has no step)
            known = [(float(s), v) for s, v in pairs if s is not None]
            curves.append(("train", [s for s, _ in known], [v for _, v in known]))
        else:
            curves.append(("train", epochs, history[name]))
    for key in eval_names(history):
        if not is_eval_of(key, name):
            continue
        label = "eval" if key == f"eval_{name}" else key[5 : -len(name) - 1]
        if by_step:
            points = [
                (float(e["step"]), e[key]) for e in history.evaluations if key in e
            ]
            curves.append((label, [s for s, _ in points], [v for _, v in points]))
        else:
            curves.append((label, epochs, history[key]))
    return curves
