"""What a plan is asked for besides the batch, and the same checked.

`PlanOptions` are the keywords `DataParallelTrainer.plan` takes (`px.plan`
documents them and passes them on); `Settings` are those options checked
and resolved on the devices JAX sees: the one bundle the search reads and
its `Plan` reports. Nothing here touches an array.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

from ._devices import DeviceSpec
from ._space import PlanSpace


class PlanOptions(NamedTuple):
    """`DataParallelTrainer.plan`'s keywords as given (`px.plan`'s
    arguments of the same names say what each means)."""

    budget: int | str | None = None
    space: PlanSpace | None = None
    margin: float = 0.1
    device: str | DeviceSpec | None = None
    devices: int | Sequence[Any] | None = None
    measure: int = 0
    progress: bool | None = None


class Settings(NamedTuple):
    """`PlanOptions` checked: what the search weighs candidates by.

    Attributes:
        devices: the devices planned for.
        space: what to choose among (the trainer's own rules where no space
            was given).
        budget: the bytes a step may take on each device.
        margin: the share of `budget` kept free.
        device: the device the cost model prices.
        measure: how many of the fastest predicted that fit are run and
            timed (0: none; the choice is by prediction).
        progress: whether the search shows its progress: True, a live bar
            on a terminal and a log line per candidate elsewhere; None, the
            bar on a terminal and nothing elsewhere; False, nothing.
    """

    devices: list[Any]
    space: PlanSpace
    budget: int
    margin: float
    device: DeviceSpec
    measure: int = 0
    progress: bool | None = None

    @property
    def usable(self) -> float:
        """The bytes a step may take on each device: `budget` less the
        margin."""
        return self.budget * (1 - self.margin)
