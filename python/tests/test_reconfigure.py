"""torch's fault-tolerance API on eccl (issue 22): ProcessGroup.abort() and abort hooks."""

import pytest

pytest.importorskip("torch")
from test_torch_backend import HERE, run_world  # noqa: E402


def test_abort_fails_calls_in_flight_at_once_and_runs_the_hooks_once():
    """Rank 0 aborts while it and rank 1 wait in an all_reduce rank 2 has not joined:
    both fail with AbortedError within a second (rank 1 is told), rank 2's next call
    fails (its epoch was aborted), each rank's hooks run once, and the next all_reduce
    over all three is right."""
    res = run_world(3, ["eccl"], HERE / "abort_script.py")
    assert res[0] == {"in_flight": "AbortedError", "fast": True, "after": [6.0, 6.0], "hooks": 1}
    assert res[1] == {"in_flight": "AbortedError", "fast": True, "after": [6.0, 6.0], "hooks": 1}
    assert res[2] == {"late_call": "AbortedError", "after": [6.0, 6.0], "hooks": 1}
