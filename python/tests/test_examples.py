"""Every example under examples/ runs, in a short form, as a user would start it. The
examples that other tests already drive with their own checks are listed in COVERED
with the test that runs them; this file runs the rest and checks what each prints."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import procs
import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Examples run by another test (file: the test that runs it), and helper modules that
# the examples import (not programs of their own).
COVERED = {
    "compare_gloo.py": "test_compare_gloo.py",
    "ddp_simple.py": "test_torch_backend.py (and ddp_example.py, eccl backend)",
    "ddp_example.py": "test_torch_backend.py; its elastic and gloo paths: compare_ddp.py below",
    "elastic_ddp.py": "test_elastic.py",
    "diloco.py": "test_elastic_train.py",
    "elastic_torchrun.py": "test_rendezvous.py",
    "elastic_train.py": "test_rendezvous.py (elastic_torchrun.py's worker)",
    "goodput.py": "test_goodput.py",
    "goodput_worker.py": "test_goodput.py (goodput.py's worker)",
    "eccl_masters.py": "a helper module: store_bench.py and elastic_torchrun.py use it",
    "ddp_cuda.py": "test_cuda.py's machine: the GPU check (.ci/gpu_check.sh) runs it on a GPU",
}
RUN_HERE = {"allreduce.py", "compare_ddp.py", "netlab.sh", "compare_transports.py", "kill_latency.py",
            "store_bench.py", "netns_transports.sh", "torch_overhead.py", "sync_cost.py",
            "catch_up.py", "compare_fsdp.py", "heal_cost.py", "shared_collectives.py",
            "contract_times.py", "compare_alltoall.py", "compare_collectives.py"}


def run(args, timeout=240, **kw):
    # Python examples are forked from the suite's zygote (procs.spawn), which has
    # imported torch already; the shell example starts as it is.
    p = procs.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
    assert p.returncode == 0, f"{args}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_every_example_is_run_by_some_test():
    examples = {f.name for f in EXAMPLES.iterdir() if f.suffix in (".py", ".sh")}
    assert examples == set(COVERED) | RUN_HERE, examples ^ (set(COVERED) | RUN_HERE)


def test_allreduce():
    out = run([sys.executable, str(EXAMPLES / "allreduce.py")], timeout=60)
    # The two processes share the pipe, so their lines may interleave. Peer ids follow
    # the order the two registered in, so either order of the two members is right.
    lines = sorted(re.findall(r"rank (\d+): (\[[^\]]*\]) \(epoch (\d+), members \[([^\]]*)\]\)", out))
    assert [(r, x, e) for r, x, e, _ in lines] == [(str(r), "[3. 3. 3. 3.]", "1") for r in range(2)], out
    members = {m for *_, m in lines}
    assert len(members) == 1 and sorted(members.pop().split(", ")) == ["1", "2"], out


def test_compare_ddp():
    out = run([sys.executable, str(EXAMPLES / "compare_ddp.py"), "--width", "64", "--steps",
               "3", "--rounds", "1"])
    for backend in ("eccl", "elastic", "gloo"):
        m = re.search(rf"^\s+{backend}\s+([0-9.]+) \.\.\s+([0-9.]+) ms/step", out, re.M)
        assert m and 0 < float(m.group(1)) <= float(m.group(2)) < 10_000, out


def test_compare_transports(tmp_path):
    out_json = tmp_path / "t.json"
    run([sys.executable, str(EXAMPLES / "compare_transports.py"), "--ranks", "2", "--sizes",
         "1K,1M", "--rounds", "1", "-n", "1", "-w", "0", "--json", str(out_json)])
    data = json.loads(out_json.read_text())
    r = data["rounds"][0]
    for t in ("tcp", "tls", "shm", "quic"):
        rows = r["eccl"][f"2/{t}"]
        assert sorted(int(s) for s in rows) == [1024, 1 << 20], rows
        assert all(row["wrong"] == 0 for row in rows.values()), rows


def test_compare_alltoall(tmp_path):
    out_json = tmp_path / "a.json"
    out = run([sys.executable, str(EXAMPLES / "compare_alltoall.py"), "--ranks", "3", "--mib", "1",
               "--iters", "2", "--rounds", "1", "--patterns", "rotated", "--json", str(out_json)])
    # Each worker checks the blocks it received; both backends timed every pattern.
    rows = json.loads(out_json.read_text())
    assert [(r["ranks"], r["pattern"]) for r in rows] == [(3, "rotated")], out
    for r in rows:
        assert all(len(t) == 1 and 0 < t[0] < 60 for t in r["median_call_s"].values()), r
        assert 0 < r["widest_block"] < r["bytes_to_others"], r
    assert re.search(r"^3 ranks, rotated: .* eccl .* gloo .* gloo/eccl", out, re.M), out


def test_compare_collectives(tmp_path):
    out_json = tmp_path / "c.json"
    ops = ["all_gather_views", "reduce_scatter", "all_to_all_views", "scatter_views", "send_recv_ring"]
    out = run([sys.executable, str(EXAMPLES / "compare_collectives.py"), "--ranks", "3", "--mib", "0.25",
               "--iters", "2", "--rounds", "1", "--ops", *ops, "--json", str(out_json)])
    rows = json.loads(out_json.read_text())
    assert [r["op"] for r in rows] == ops, out
    assert all(0 < t < 60 for r in rows for t in r["eccl_s"] + r["gloo_s"]), rows
    assert re.search(r"^3 ranks scatter_views .* gloo/eccl [0-9.]+-[0-9.]+x$", out, re.M), out


def test_kill_latency():
    out = run([sys.executable, str(EXAMPLES / "kill_latency.py"), "--trials", "1", "--ranks",
               "2", "--backends", "eccl,gloo", "--reconfigure"])
    # One survivor's error per backend, eccl's naming its cause; eccl's reconfigure of the
    # survivor ran and its all_reduce after was right (inf otherwise).
    m = re.search(r"^eccl, 2 ranks: 1 survivors' errors after SIGKILL: p50 ([0-9.]+) ms", out, re.M)
    assert m and float(m.group(1)) < 5000, out
    assert "AbortedError" in out, out
    assert re.search(r"^gloo, 2 ranks: 1 survivors' errors after SIGKILL", out, re.M), out
    rec = re.search(r"_reconfigure of 1 survivors: p50 ([0-9.inf]+) ms", out)
    assert rec and rec.group(1) != "inf", out


def test_sync_cost():
    out = run([sys.executable, str(EXAMPLES / "sync_cost.py"), "--members", "2", "--state-mb",
               "8", "--rounds", "2"], timeout=120)
    rows = dict(re.findall(r"^(hash|unchanged)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", out, re.M))
    # Everything hashed without the promise, nothing with it.
    assert rows == {"hash": str(8 << 20), "unchanged": "0"}, out


def test_catch_up():
    out = run([sys.executable, str(EXAMPLES / "catch_up.py"), "--members", "2", "--state-mb",
               "8", "--rounds", "2"], timeout=120)
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)", out, re.M)
    # Two newcomers, each fetched the whole state (the example checks its content).
    assert [r for r, _ in rows] == ["0", "1"] and all(float(g) > 0 for _, g in rows), out
    assert re.search(r"^# median: [\d.]+ ms to the first synced all_reduce", out, re.M), out


def test_heal_cost():
    out = run([sys.executable, str(EXAMPLES / "heal_cost.py"), "--members", "2", "--params-mb", "1",
               "--width", "256", "--batch", "8", "--join-at", "3"], timeout=180)
    # Both modes ran, and every rank ended with the same parameters (the example checks).
    for mode in ("background", "boundary"):
        assert re.search(rf"^round 0 +{mode}: members' step [\d.]+ ms before, [\d.]+ ms in the step "
                         r"that admitted the newcomer", out, re.M), out


def test_compare_fsdp():
    out = run([sys.executable, str(EXAMPLES / "compare_fsdp.py"), "--nproc", "2", "--width", "64",
               "--layers", "2", "--steps", "2", "--rounds", "1", "--alloc"], timeout=180)
    assert re.search(r"^eccl\s+[\d.]+$", out, re.M) and re.search(r"^gloo\s+[\d.]+$", out, re.M), out
    # FSDP2's buffers from allocate_tensor (the example fails if FSDP2 never asked).
    assert re.search(r"^eccl-alloc\s+[\d.]+$", out, re.M), out
    # FSDP2 over eccl ends with gloo's loss, bit for bit.
    assert re.search(r"^# last loss: .*\(equal\)$", out, re.M), out


def test_shared_collectives():
    out = run([sys.executable, str(EXAMPLES / "shared_collectives.py"), "--ranks", "2",
               "--sizes", "2M", "--iters", "2"], timeout=120)
    assert re.search(r"^\s+2 MiB\s+all_gather plain\s+[\d.]+ ms shared\s+[\d.]+ ms", out, re.M), out


def test_contract_times():
    out = run([sys.executable, str(EXAMPLES / "contract_times.py"), "--rounds", "1",
               "--scenarios", "basic"], timeout=120)
    # Both backends ran the scenario (a failure prints "failed" instead of times).
    assert re.search(r"^basic\s+[\d.]+-\s*[\d.]+\s+[\d.]+-\s*[\d.]+\s+[\d.]+", out, re.M), out


def test_store_bench():
    out = run([sys.executable, str(EXAMPLES / "store_bench.py"), "--n", "20", "--rounds", "1"])
    assert re.search(r"^store\s+set\s+get\s+add\s+compare_set$", out, re.M), out
    for store in ("TCPStore", r"eccl, 1 master \(memory\)", r"eccl, 3 masters \(--data-dir\)"):
        assert re.search(rf"^{store}(\s+\d+-\d+ \(\d+\)){{4}}$", out, re.M), out


def test_torch_overhead(tmp_path):
    out = run([sys.executable, str(EXAMPLES / "torch_overhead.py"), "--ranks", "2", "--sizes",
               "1K,64K", "--iters", "50,10", "--rounds", "2", "--json", str(tmp_path / "o.json")])
    for size in (1024, 65536):
        assert re.search(rf"^n=2 +{size} B  native +[0-9.]+ us  torch +[0-9.]+ us", out, re.M), out
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert [(r["ranks"], r["bytes"]) for r in rows] == [(2, 1024), (2, 65536)], rows
    for r in rows:
        assert len(r["native_us"]) == len(r["torch_us"]) == len(r["overhead_us"]) == 2, r
        assert all(t > 0 for t in r["native_us"] + r["torch_us"]), r


def _netns_possible():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    name = f"eccl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


def _need_netns():
    """Skips the test, saying why, where network namespaces cannot be made."""
    if not _netns_possible():
        from conftest import not_possible_here
        not_possible_here("network namespaces cannot be made (needs root, ip and tc)")


def test_netlab_slow_pair(tmp_path):
    """The network lab's slow-pair scenario, short: four peers in namespaces of their
    own, two links 100x slower than the rest. The solved ring avoids them (the issue's
    target: at least 2x rank order's bus bandwidth), results exact both times; int8 on
    the wire beats rank order too, and more over the solved ring, within its bound; and
    the lab removes what it made."""
    _need_netns()
    out_json = tmp_path / "lab.json"
    out = run(["bash", str(EXAMPLES / "netlab.sh"), "--scenario", "slow-pair", "--size", "256K",
               "--iters", "2", "--json", str(out_json)], timeout=180)
    r = json.loads(out_json.read_text())
    assert r["scenario"] == "slow-pair" and sorted(r["ring"]) == [0, 1, 2, 3], r
    slow = {(0, 1), (1, 0), (2, 3), (3, 2)}
    ring = r["ring"]
    assert not {(ring[k], ring[(k + 1) % 4]) for k in range(4)} & slow, r
    assert r["speedup"] >= 2.0, out
    # int8 on the wire in rank order: a quarter of the bytes through the same slow links.
    assert r["quantized_speedup"] >= 2.0, out
    # And after optimize_topology(), whose master models the measured links: an all_to_all
    # straight across the 100x slower links loses to relaying around the solved ring, at
    # every size, and so does a small all_reduce's direct exchange (the default for four
    # ranks); the relayed codes cross no slow link (205x rank order's time where int8 in
    # rank order was 15x).
    assert "all_to_all: ring beyond" in r["algorithms"], r
    assert r["algorithms"].startswith("broadcast:") and "all_reduce: ring" in r["algorithms"], r
    assert r["quantized_ring_speedup"] >= 2 * r["quantized_speedup"], out
    # The int8 runs were checked element by element against the documented bound, the
    # same bits on every rank (netlab.sh fails otherwise); their error is not zero.
    assert 0 < r["quantized_max_rel_error"] < 0.05, r
    assert "eccl-sw-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout


def test_netlab_long_fat(tmp_path):
    """The lab's long fat path: two peers whose links cross a 100 ms round trip shaped to
    400 mbit (a TUN pair relayed by eccl-bench delay-link: netem is not available). One
    TCP connection per link is held back by its window; after optimize_topology() with
    ECCL_NSTREAMS=auto the master stripes the link over 4 connections, results exact both
    times, and the lab removes what it made. What the stripes gain is a measurement, not
    asserted here (docs/measurements.md: 70-89 % of the rate striped, 50-55 % with one
    connection, on an idle host; a CI run with the test suite beside it once measured a
    two-iteration striped run at 38 % against 51 %). The rates and the probe's verdict
    (`# probe:`) are printed for a failure's diagnosis."""
    _need_netns()
    out_json = tmp_path / "lab.json"
    out = run(["bash", str(EXAMPLES / "netlab.sh"), "--scenario", "long-fat", "--size", "16M",
               "--iters", "2", "--json", str(out_json)], timeout=240)
    r = json.loads(out_json.read_text())
    assert re.search(r"# striped: rank 0 <-> rank 1 over 4 connections", out), out
    # Both runs moved the whole buffer (netlab.sh checked every element) at some rate.
    assert r["striped_rate_fraction"] > 0 and r["one_connection_rate_fraction"] > 0, out
    print(out)
    assert "eccl-sw-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout


def test_netns_transports():
    _need_netns()
    out = run(["bash", str(EXAMPLES / "netns_transports.sh"), "100mbit", "1M"], timeout=180)
    for t in ("tcp", "tls", "quic"):
        assert re.search(rf"transport {t}\b", out), out
    assert "Out of bounds values : 0 OK" in out, out
    # It removed the namespaces it made.
    assert "eccl-a-" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout
