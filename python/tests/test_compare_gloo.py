"""The eccl-vs-gloo benchmark script runs end to end with real torch and gloo processes
and real eccl-bench processes, and reports sane numbers for both; its --plot and
eccl-bench's draw what was measured."""

import json
import pathlib
import subprocess
import sys

import procs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compare_gloo_small(tmp_path):
    out = tmp_path / "cmp.json"
    svg = tmp_path / "cmp.svg"
    r = procs.run(
        [sys.executable, str(ROOT / "examples" / "compare_gloo.py"), "--ranks", "2",
         "-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "--json", str(out),
         "--transports", "shm,tcp", "--plot", str(svg)],
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
    # Both transports ran, the first is the table's, and the picture has one series per
    # transport and gloo's, on both panels, over the sizes measured.
    assert set(data["eccl_by_transport"]) == {"shm", "tcp"}
    assert data["eccl"] == data["eccl_by_transport"]["shm"]
    check_svg(svg.read_text(), ["eccl shm", "eccl tcp", "gloo"])


BENCH = ROOT / "target" / "release" / "eccl-bench"


def check_svg(text, series):
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>"), text[:200]
    for label in [*series, "bus bandwidth (GB/s)", "time (us)", "message size", "1 KiB", "64 KiB"]:
        assert label in text, label


def test_bench_plots_its_own_run_and_refuses_what_it_cannot_draw(tmp_path):
    svg = tmp_path / "run.svg"
    r = subprocess.run([str(BENCH), "all_reduce", "--local", "2", "-b", "1K", "-e", "64K", "-f", "8",
                        "-n", "2", "-w", "1", "--json", str(tmp_path / "run.json"), "--plot", str(svg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    transport = json.loads((tmp_path / "run.json").read_text())["transport"]
    check_svg(svg.read_text(), [f"eccl {transport}"])
    for args, reason in [
        ([str(tmp_path / "run.png"), str(tmp_path / "run.json")], "name the file *.svg"),
        ([str(svg), str(tmp_path / "missing.json")], "cannot read"),
        ([str(svg), str(svg)], "is not an eccl-bench --json result"),
        ([str(svg)], "usage: eccl-bench plot"),
    ]:
        bad = subprocess.run([str(BENCH), "plot", *args], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and reason in bad.stderr, (args, bad.stderr)
