"""The Python layer's unsafe code under valgrind's memcheck: the native side reads and
writes the buffers that Python hands it (numpy arrays, read-only ones included), also
while the Work that asked for it is dropped and collected and while the interpreter exits
with a call in flight. Memcheck reports any access to freed or unowned memory, which the
canaries of test_api.py could miss when the memory was not reused. (Miri, which covers the
executor and the shared-memory ring, cannot run code that calls into C.)"""

import os
import re
import shutil
import subprocess
import sys

import eccl
import pytest

TIMEOUT = 300

BODY = """
import gc, os, sys, time, json
import numpy as np, eccl
rank = int(sys.argv[1])
dropped = sys.argv[2]
comm = eccl.Communicator(ADDR, SECRET, rank_hint=rank, min_world=2)
comm.update_topology()
N, M = 1 << 22, 1 << 16
canaries = []
# A use-after-free once: the Work of a pending recv is dropped and collected.
if rank == 0:
    while not os.path.exists(dropped):      # rank 1's Work is gone: now send
        time.sleep(0.01)
    comm.send(np.full(N, 7.0, np.float32), 1)
else:
    w = comm.recv(np.empty(N, np.float32), 0, async_op=True)
    del w
    gc.collect()
    canaries.append(np.zeros(N, np.float32))
    open(dropped, "w").close()
# In-flight all_reduces whose Works and arrays are dropped at once.
for i in range(6):
    if i % 2 == rank:
        time.sleep(0.05)
    w = comm.all_reduce(np.full(M, 1.0, np.float32), async_op=True)
    del w
    gc.collect()
    canaries.append(np.zeros(M, np.float32))
# Read-only inputs are read, never written.
ro = np.arange(M, dtype=np.float32) + rank
ro.flags.writeable = False
out = np.empty(2 * M, np.float32)
comm.all_gather(out, ro)
ok = bool((out[:M] == np.arange(M)).all() and (out[M:] == np.arange(M) + 1).all())
comm.barrier()
changed = sum(int((c != 0).sum()) for c in canaries)
print("RESULT", json.dumps({"changed": changed, "gathered": ok}), flush=True)
# Exit with a call in flight that the other rank never joins.
if rank == 1:
    w = comm.all_reduce(np.ones(M, np.float32), async_op=True)
"""


# glibc's dynamic loader reads a word past short strings while it expands an rpath
# (an aligned over-read valgrind cannot tell from a real one); numpy's libraries hit it.
SUPPRESSIONS = """
{
   ld.so strncmp over-read while expanding an rpath
   Memcheck:Addr8
   fun:strncmp
   fun:is_dst
}
"""


def _memcheck():
    return shutil.which("valgrind")


@pytest.mark.skipif(_memcheck() is None, reason="valgrind is not installed (bash .ci/test.sh installs it)")
@pytest.mark.timeout(TIMEOUT + 60)
def test_the_python_layer_is_clean_under_memcheck(tmp_path):
    # A rank under memcheck runs tens of times slower, its heartbeats included: a long
    # lease keeps it from being evicted for being slow.
    master = eccl.Master(lease_ms=10000, heartbeat_ms=500)
    script = BODY.replace("ADDR", repr(master.addr)).replace("SECRET", repr(master.secret))
    env = dict(os.environ, PYTHONMALLOC="malloc")
    supp = tmp_path / "eccl.supp"
    supp.write_text(SUPPRESSIONS)
    # Invalid reads and writes are what a use-after-free or a stray pointer makes;
    # undefined-value reports are left out, as CPython and ring's assembly (whose
    # ciphertext valgrind cannot follow) fill them with false alarms.
    memcheck = [_memcheck(), "--tool=memcheck", "--error-exitcode=99", "--leak-check=no",
                "--undef-value-errors=no", f"--suppressions={supp}", "--num-callers=30"]
    procs = []
    try:
        for rank in range(2):
            cmd = [sys.executable, "-c", script, str(rank), str(tmp_path / "dropped")]
            if rank == 1:
                cmd = memcheck + cmd
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.shutdown()
    (out0, err0), (out1, err1) = outs
    assert procs[0].returncode == 0, err0
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors", err1)
    assert summary, f"no memcheck summary:\n{err1[-4000:]}"
    assert procs[1].returncode == 0 and summary[-1] == "0", f"memcheck found errors:\n{err1[-12000:]}"
    for out in (out0, out1):
        line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
        assert line.endswith('{"changed": 0, "gathered": true}'), line
