"""grain's own `DataLoader` given to `fit` directly on 2 processes, each
reading its own shard (``ShardByJaxProcess``) with 2 worker processes
(issue 45, item 1): each process's iterator state is saved with the run and
given back to it, and the run resumes bitwise; resuming on another process
count is refused in one line. (In a file of its own: the test suite's
workers take whole files.)"""

import numpy as np
import pytest

from test_grain_resume import STEPS, _run


@pytest.mark.slow
def test_grain_dataloader_sharded_per_process_resumes_each_process_bitwise(tmp_path):
    """grain's DataLoader given to fit directly, each of 2 processes reading
    its own shard: every process's iterator state is saved, and each gets
    its own back (with 2 workers each)."""
    direct = ("--direct", "--workers", "2")
    straight = tmp_path / "straight"
    _run(straight, str(STEPS), *direct, processes=2)
    checkpoints = str(tmp_path / "checkpoints")
    _run(tmp_path / "stopped", "4", *direct, "--checkpoints", checkpoints, processes=2)
    resumed = tmp_path / "resumed"
    _run(
        resumed,
        str(STEPS),
        *direct,
        "--checkpoints",
        checkpoints,
        "--resume",
        processes=2,
    )
    for rank in (0, 1):
        np.testing.assert_equal(
            dict(np.load(resumed / f"rank{rank}.npz")),
            dict(np.load(straight / f"rank{rank}.npz")),
        )
    # Each process's shard is its own: resumed on 1 process, refused.
    said = _run(
        tmp_path / "one",
        str(STEPS),
        *direct,
        "--checkpoints",
        checkpoints,
        "--resume",
        ok=False,
    )
    assert "data positions of 2 processes" in said
