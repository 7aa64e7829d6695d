"""torch.distributed conformance (issue 20, in progress): calls beyond the plain
collectives give gloo's results under "eccl", at 3 and 4 ranks; the backend is torch's
c10d Backend shape (registered per device, group names set)."""

import pytest

pytest.importorskip("torch")
from test_torch_backend import HERE, run_world  # noqa: E402


@pytest.mark.parametrize("n", [3, 4])
def test_calls_beyond_the_plain_collectives_match_gloo(n):
    script = HERE / "conformance_script.py"
    gloo = run_world(n, ["gloo"], script)
    ours = run_world(n, ["eccl"], script)
    for r in range(n):
        assert set(ours[r]) == set(gloo[r]), r
        for key in gloo[r]:
            assert ours[r][key] == gloo[r][key], f"rank {r} {key}: {ours[r][key]} vs {gloo[r][key]}"


def test_monitored_barrier_names_the_missing_ranks_as_gloo_does():
    """Everyone arrives: all pass. Rank 2 arrives 2 s past a 1 s timeout: rank 0 names
    it in gloo's words, the others raise too."""
    script = HERE / "monitored_script.py"
    gloo = run_world(3, ["gloo"], script)
    ours = run_world(3, ["eccl"], script)
    assert ours == gloo, (ours, gloo)
    assert gloo[0]["late"] == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1000 ms"
