"""torch's fault-tolerance API on eccl (issue 22): ProcessGroup.abort() and abort hooks,
shrink_group."""

import pytest

pytest.importorskip("torch")
from test_torch_backend import HERE, run_world, run_world_losing_last  # noqa: E402


def test_abort_fails_calls_in_flight_at_once_and_runs_the_hooks_once():
    """Rank 0 aborts while it and rank 1 wait in an all_reduce rank 2 has not joined:
    both fail with AbortedError within a second (rank 1 is told), rank 2's next call
    fails (its epoch was aborted), each rank's hooks run once, and the next all_reduce
    over all three is right."""
    res = run_world(3, ["eccl"], HERE / "abort_script.py")
    assert res[0] == {"in_flight": "AbortedError", "fast": True, "after": [6.0, 6.0], "hooks": 1}
    assert res[1] == {"in_flight": "AbortedError", "fast": True, "after": [6.0, 6.0], "hooks": 1}
    assert res[2] == {"late_call": "AbortedError", "after": [6.0, 6.0], "hooks": 1}


@pytest.mark.parametrize("n", [3, 4])
def test_shrink_group_drops_a_killed_rank_where_gloo_refuses(n):
    """Rank n-1 is SIGKILLed; the others call shrink_group([n-1]) and all_reduce on the
    shrunk default group: right sums, world n-1, ranks in their old order, within 5 s.
    gloo, in the same scenario, refuses shrinking with TypeError."""
    script = HERE / "shrink_script.py"
    for backend in ("gloo", "eccl"):
        res = run_world_losing_last(n, [backend], script)
        if backend == "gloo":
            assert res == [{"error": "TypeError"}] * (n - 1), res
        else:
            total = float(sum(range(1, n)))
            assert res == [{"sum": [total, total], "rank": r, "size": n - 1,
                            "group_size": n - 1, "quick": True} for r in range(n - 1)], res

