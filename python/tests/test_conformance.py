"""torch.distributed conformance: the documented CPU calls give gloo's results
under "eccl", at 3 and 4 ranks: the collectives and their coalesced and tensor forms, the
object collectives, p2p with any-source receives and batches, subgroups in every form,
monitored_barrier, group timeouts, futures; and a subgroup survives a rank lost outside
it."""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
from procs import free_port  # noqa: E402
from test_torch_backend import HERE, run_processes, run_world, run_world_losing_last  # noqa: E402


@pytest.mark.parametrize("n", [3, 4])
def test_calls_beyond_the_plain_collectives_match_gloo(n):
    script = HERE / "conformance_script.py"
    with ThreadPoolExecutor(2) as ex:
        gloo = ex.submit(run_world, n, ["gloo"], script)
        ours = ex.submit(run_world, n, ["eccl"], script)
        gloo, ours = gloo.result(), ours.result()
    for r in range(n):
        # The subgroup calls ran (an exception's name equal under both would hide a
        # torch without the API): split_group always, new_subgroups of 2 where n is even.
        assert isinstance(ours[r]["split_group"], list), ours[r]
        assert isinstance(ours[r]["new_subgroups"], list) == (n % 2 == 0), ours[r]
        assert set(ours[r]) == set(gloo[r]), r
        for key in gloo[r]:
            if key in BETTER_THAN_GLOO:
                continue
            assert ours[r][key] == gloo[r][key], f"rank {r} {key}: {ours[r][key]} vs {gloo[r][key]}"
        # After rank 0's receive timed out, gloo closed the pair; eccl's group goes on.
        assert gloo[r]["after_recv_timeout"] == "RuntimeError", gloo[r]
        assert ours[r]["after_recv_timeout"] == [n * (n + 1) / 2], ours[r]


BETTER_THAN_GLOO = {"after_recv_timeout"}


# Four ranks: two arrive late, so gloo's message names a list (three would name one).
@pytest.mark.parametrize("n", [4])
def test_monitored_barrier_names_the_missing_ranks_as_gloo_does(n):
    """Everyone arrives: all pass. Ranks 2 and up arrive 2 s past a 1 s timeout: rank 0
    names them all (wait_all_ranks) in gloo's words, the others raise too."""
    script = HERE / "monitored_script.py"
    # Side by side: each world spends its time waiting for its late ranks.
    with ThreadPoolExecutor(2) as ex:
        gloo = ex.submit(run_world, n, ["gloo"], script)
        ours = ex.submit(run_world, n, ["eccl"], script)
        gloo, ours = gloo.result(), ours.result()
    assert ours == gloo, (ours, gloo)
    late = ", ".join(str(r) for r in range(2, n))
    assert gloo[0]["late"] == f"[Rank 0]: Ranks {late} failed to pass monitoredBarrier in 1000 ms"


def test_a_subgroup_survives_the_loss_of_a_rank_outside_it():
    """Ranks 0 and 1 of three form a group; rank 2 is SIGKILLed; the group's collectives
    go on with the right sums (an eccl subgroup is a world of its own)."""
    res = run_world_losing_last(3, ["eccl"], HERE / "subgroup_loss_script.py")
    assert res == [{"sums": [[3.0 + 2 * i] * 4 for i in range(3)]}] * 2, res


def test_a_device_map_picks_the_eccl_backend_for_cpu():
    res = run_world(2, ["cpu:eccl"], HERE / "device_map_script.py")
    assert res == [{"sum": [3.0, 3.0], "backend": "ProcessGroupEccl"}] * 2, res


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_init_methods_as_gloo_takes_them(tmp_path, scheme):
    method = (f"file://{tmp_path / 'init'}" if scheme == "file"
              else f"tcp://127.0.0.1:{free_port()}")
    script = HERE / "init_method_script.py"
    specs = [([sys.executable, str(script), "eccl", method, str(r), "3"], dict(os.environ))
             for r in range(3)]
    assert run_processes(specs) == [{"sum": [6.0, 6.0]}] * 3
