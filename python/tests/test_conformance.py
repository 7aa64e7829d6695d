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
