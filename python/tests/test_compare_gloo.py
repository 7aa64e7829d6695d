"""The eccl-vs-gloo benchmark script runs end to end with real torch and gloo processes
and real eccl-bench processes, and reports sane numbers for both."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_compare_gloo_small(tmp_path):
    out = tmp_path / "cmp.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compare_gloo.py"), "--ranks", "2",
         "-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())["2"]
    assert [row["bytes"] for row in data["eccl"]] == [1024, 8192, 65536]
    assert [row["bytes"] for row in data["gloo"]] == [1024, 8192, 65536]
    for impl in ("eccl", "gloo"):
        for row in data[impl]:
            assert row["time_us"] > 0 and row["busbw_gbps"] > 0
    assert "busbw eccl/gloo" in r.stdout
