"""The eccl-vs-gloo benchmark script runs end to end with real torch and gloo processes
and real eccl-bench processes, and reports sane numbers for both."""

import json
import pathlib
import sys

import procs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compare_gloo_small(tmp_path):
    out = tmp_path / "cmp.json"
    r = procs.run(
        [sys.executable, str(ROOT / "examples" / "compare_gloo.py"), "--ranks", "2",
         "-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())["2"]
    assert [row["bytes"] for row in data["eccl"]] == [1024, 8192, 65536]
    assert [row["bytes"] for row in data["gloo"]] == [1024, 8192, 65536]
    # Each figure is what its time says (nccl-tests' all_reduce factor 2(n-1)/n), and a
    # time is one of a real call: between a microsecond and a second for 64 KiB here.
    for impl in ("eccl", "gloo"):
        for row in data[impl]:
            assert 1 <= row["time_us"] < 1e6, row
            algbw = row["bytes"] / row["time_us"] / 1e3
            assert abs(row["busbw_gbps"] - algbw * 2 * (2 - 1) / 2) <= 1e-9 * algbw, row
    # eccl's rows were checked element by element (-c).
    assert [row["wrong"] for row in data["eccl"]] == [0, 0, 0]
    # The table prints each size's ratio from those rows.
    table = [line.split() for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(t[0]) for t in table] == [1024, 8192, 65536], r.stdout
    for t, er, gr in zip(table, data["eccl"], data["gloo"]):
        # size | eccl us busbw | gloo us busbw | busbw eccl/gloo, time gloo/eccl
        assert abs(float(t[8]) - er["busbw_gbps"] / gr["busbw_gbps"]) <= 0.006, (t, er, gr)
