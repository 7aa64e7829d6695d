"""The suite's rules, for every test file here.

- Every test has a time limit (pytest-timeout; the default is in python/pyproject.toml,
  longer ones say so with `@pytest.mark.timeout(S)`), so a hang fails one test with a
  stack instead of the whole run at CI's limit.
- Skips are printed (`-rs`). Under CI (the variable `CI` set, as `.ci/run` is called), a
  skip fails the run unless it is an opt-in (a test that runs only behind a flag says so
  with `opt_in(FLAG, why)`) or the machine cannot do it at all (`not_possible_here(why)`:
  network namespaces where the sandbox forbids them). Anything else that skips there
  (valgrind missing, a torch without the API a test needs) hides a broken set-up, and
  the run says which.
- Torch runs one intra-op thread per process (`OMP_NUM_THREADS=1`, as torchrun sets it
  for more than one process per node), unless the caller set it: the tests run two to
  six ranks, agents and masters on a machine of two cores, where each process's own
  thread pool spins against the others' (test_elastic's kill-and-join: 54 -> 29 CPU
  seconds, 29.5 -> 17 s). The variable reaches every process a test starts.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

OPT_IN = "opt-in:"
NOT_POSSIBLE = "not possible on this machine:"


def opt_in(flag: str, why: str) -> None:
    """Skips the calling module unless the environment variable `flag` is set: for
    tests kept out of the default run on purpose (long soaks, tools installed apart)."""
    if not os.environ.get(flag):
        pytest.skip(f"{OPT_IN} runs with {flag}=1 ({why})", allow_module_level=True)


def not_possible_here(why: str) -> None:
    """Skips the calling test: this machine cannot do what it needs, whatever is
    installed (say why)."""
    pytest.skip(f"{NOT_POSSIBLE} {why}")


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    hidden = [r for r in reporter.stats.get("skipped", [])
              if OPT_IN not in _reason(r) and NOT_POSSIBLE not in _reason(r)]
    if hidden:
        lines = "\n".join(f"  {r.nodeid or r.fspath}: {_reason(r)}" for r in hidden)
        reporter.write_line(f"CI: {len(hidden)} test(s) skipped for a reason that is not "
                            f"an opt-in flag; under CI that fails the run:\n{lines}",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The tests that spend most of their time waiting (on leases, group timeouts, killed or
# stopped ranks, shaped links) or on one core (valgrind): `.ci/test.sh` runs them in a
# second pytest process (`-m beside`) beside the rest (`-m "not beside"`), which leave a
# fraction of a core idle on two. Measured with ECCL_TEST_CPU on 2026-11-29 (wall s, CPU
# s of the whole machine): the tests below 250 s and 236 CPU s of a 530 s, 713 CPU s run
# (one process); the two processes at once took 363 s before test_rendezvous.py moved
# here (the rest's 360 s against 211). A plain `pytest python/tests` runs them all in
# one process.
BESIDE_FILES = {
    "test_elastic.py",        # kills and joins: 68 s, 84 CPU s
    "test_reconfigure.py",    # gloo's group timeouts, hung ranks: 17 s, 6 CPU s
    "test_conformance.py",    # monitored barriers, late ranks: 11 s, 4 CPU s
    "test_torch_window.py",   # dead and stopped peers, window waits
    "test_masters.py",        # a stopped leader
    "test_memcheck.py",       # one process under valgrind: one core
    "test_rendezvous.py",     # torchrun agents losing a node and the leader: 44 s, 58
}
BESIDE_TESTS = {
    "test_netlab_long_fat",   # 20 s, 2.6 CPU s: probes across a 100 ms round trip
    "test_netlab_slow_pair",
    "test_netns_transports",
    "test_store_bench",
    "test_diloco_survives_a_death_in_the_outer_step_and_admits_a_newcomer",  # 13 s, 10
    "test_a_diloco_newcomer_fetches_again_from_the_member_left_when_one_dies",
    "test_an_in_place_all_to_all_that_fails_leaves_its_tensor_as_it_was",  # a lease
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "beside: a test that mostly waits; .ci/test.sh runs these in a second "
        "pytest process beside the others (conftest.BESIDE_FILES, BESIDE_TESTS)")
    # The two processes draw loopback ports from classes of their own (procs.free_port).
    marks = (config.getoption("markexpr", "") or "").strip()
    if marks in ("beside", "not beside"):
        import procs
        procs.PORT_CLASS = 1 if marks == "beside" else 0
        os.environ["TEST_PORT_CLASS"] = str(procs.PORT_CLASS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in BESIDE_FILES \
                or getattr(item, "originalname", item.name) in BESIDE_TESTS:
            item.add_marker(pytest.mark.beside)


def _machine_cpu_s() -> float:
    """CPU seconds the whole machine spent since boot, every core (user, nice, system,
    irq, softirq), as .ci/test.sh counts a phase's."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ECCL_TEST_CPU=FILE, appends a line per test to FILE: its node id, its wall
    time (setup, call and teardown) and the CPU seconds the whole machine spent
    meanwhile. A test that takes long but little CPU (it waits on leases, timeouts or
    shaped links) can run beside the others (`BESIDE_FILES`, `BESIDE_TESTS` above)."""
    path = os.environ.get("ECCL_TEST_CPU")
    if not path:
        yield
        return
    import time

    t0, c0 = time.monotonic(), _machine_cpu_s()
    yield
    wall, cpu = time.monotonic() - t0, _machine_cpu_s() - c0
    with open(path, "a") as f:
        f.write(f"{wall:.2f} {cpu:.2f} {item.nodeid}\n")
