"""The torch backend's recovery (`eccl.torch_recovery`): the state machine on a stand-in
communicator (its logic only; the real thing runs in test_reconfigure.py and
test_torch_train.py), and that every call of the backend goes through it by
construction."""

import pytest

torch = pytest.importorskip("torch")

import eccl  # noqa: E402
from eccl.torch_recovery import NOT_CALLS, RECOVERING, Fault, Recovery, State  # noqa: E402


class World:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


class Comm:
    """What Recovery uses of an eccl.Communicator: its epoch and update_topology()."""

    def __init__(self, rank=1, size=3):
        self.epoch, self.rank, self.world_size = 4, rank, size
        self.updates = 0
        self.next_world = World(rank, size)
        self.fail_update = None

    def update_topology(self):
        if self.fail_update is not None:
            raise self.fail_update
        self.updates += 1
        self.epoch += 1
        return self.next_world


def test_an_aborting_failure_makes_the_next_call_form_the_next_epoch_once():
    comm = Comm()
    r = Recovery(comm, 1, 3)
    r.before_call()
    assert comm.updates == 0 and r.state is State.FORMED
    r.failed(eccl.MismatchError("counts differ"), "collective")
    assert r.state is State.ABORTED and isinstance(r.error, eccl.MismatchError)
    r.before_call()
    r.before_call()
    assert comm.updates == 1 and r.state is State.FORMED


@pytest.mark.parametrize("kind,error,aborts", [
    ("collective", eccl.InvalidArgumentError("x"), True),
    ("collective", eccl.EcclTimeoutError("x"), True),
    ("collective", eccl.AbortedError("x"), True),
    ("p2p", eccl.InvalidArgumentError("x"), False),
    ("p2p", eccl.EcclTimeoutError("x"), False),
    ("p2p", eccl.AbortedError("x"), True),
    ("control", eccl.InvalidArgumentError("x"), False),
    ("collective", ValueError("not eccl's"), False),
])
def test_which_failures_abort_the_epoch(kind, error, aborts):
    comm = Comm()
    r = Recovery(comm, 1, 3)
    ran = []
    r.hooks[7] = lambda: ran.append(comm.epoch)
    r.failed(error, kind)
    assert (r.state is State.ABORTED) == aborts
    assert ran == ([4] if aborts else [])
    assert r.error is error


def test_hooks_run_once_per_aborted_epoch_and_a_failing_hook_is_not_the_calls():
    comm = Comm()
    r = Recovery(comm, 1, 3)
    ran = []
    r.hooks[1] = lambda: ran.append("a")
    r.hooks[2] = lambda: 1 / 0
    r.aborted()
    r.failed(eccl.AbortedError("the same epoch"), "collective")
    assert ran == ["a"]
    r.before_call()                # the next epoch
    r.failed(eccl.AbortedError("again"), "p2p")
    assert ran == ["a", "a"]


def test_a_failed_recovery_is_tried_again_and_a_changed_world_is_refused():
    comm = Comm()
    r = Recovery(comm, 1, 3)
    r.aborted()
    comm.fail_update = eccl.EcclTimeoutError("no master")
    with pytest.raises(eccl.EcclTimeoutError):
        r.before_call()
    assert r.state is State.ABORTED
    comm.fail_update = None
    comm.next_world = World(0, 2)
    with pytest.raises(eccl.AbortedError, match="from 3 ranks to 2.*re-create it"):
        r.before_call()
    # Every later call too (it would run with 3 ranks' size on a world of 2), without
    # forming yet another epoch.
    updates = comm.updates
    for _ in range(2):
        with pytest.raises(eccl.AbortedError, match="from 3 ranks to 2"):
            r.before_call()
    assert comm.updates == updates and r.state is State.CHANGED
    reconf = Recovery(Comm(), 1, 3, reconfigurable=True)
    reconf.aborted()
    reconf.comm.next_world = World(0, 2)
    with pytest.raises(eccl.AbortedError, match="dist._reconfigure"):
        reconf.before_call()
    with pytest.raises(eccl.AbortedError, match="dist._reconfigure"):
        reconf.before_call()
    reconf.comm.rank, reconf.comm.world_size = 0, 2
    reconf.adopt()                 # a reconfigure took the new world
    reconf.before_call()
    assert (reconf.rank, reconf.size, reconf.state) == (0, 2, State.FORMED)


def test_two_threads_that_find_the_group_aborted_form_one_epoch():
    """Two threads call at once after an abort: one forms the next epoch, the other waits
    for it and goes on in it. (Both used to vote; the second vote, alone in its round,
    waited for the other ranks until the join timeout.)"""
    import threading
    import time

    comm = Comm()
    slow = comm.update_topology

    def update_topology():
        time.sleep(0.2)      # a round at the master: the other thread arrives meanwhile
        return slow()
    comm.update_topology = update_topology
    r = Recovery(comm, 1, 3)
    r.aborted()
    start = threading.Barrier(2)
    errors = []

    def call():
        start.wait()
        try:
            r.before_call()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and comm.updates == 1 and r.state is State.FORMED


def test_a_call_right_after_an_unwaited_reconfigure_sees_its_world():
    """`dist._reconfigure(...)` returns a Work; a call made before anyone waited on it
    (and rank()/size(), through `await_forming`) waits for it first, as gloo's, which is
    done when it returns: the call is checked against the new world's rank and size, not
    the old one's. A reconfigure that fails leaves the group where it was."""
    comm = Comm(rank=0, size=2)
    r = Recovery(comm, 0, 0, unformed=True, reconfigurable=True)

    class Forming:
        def __init__(self, fails):
            self.fails, self.waited = fails, 0

        def wait(self):
            self.waited += 1
            if self.fails:
                raise eccl.AbortedError("a member of the new world died")
            r.adopt()
    r.forming = w = Forming(fails=False)
    r.before_call()
    assert (r.rank, r.size, r.state, w.waited, r.forming) == (0, 2, State.FORMED, 1, None)
    r.before_call()
    assert w.waited == 1 and comm.updates == 0
    comm.rank, comm.world_size = 1, 3
    r.forming = w = Forming(fails=True)
    r.before_call()
    assert (r.rank, r.size, r.state, w.waited, r.forming) == (0, 2, State.FORMED, 1, None)


def test_an_unformed_group_refuses_calls_until_a_reconfigure_adopts_a_world():
    comm = Comm(rank=0, size=2)
    r = Recovery(comm, 0, 0, unformed=True, reconfigurable=True)
    with pytest.raises(eccl.InvalidArgumentError, match="no world yet"):
        r.before_call()
    r.adopt()
    assert (r.rank, r.size, r.state) == (0, 2, State.FORMED)
    r.before_call()
    assert comm.updates == 0


def test_a_late_failure_of_a_call_the_reconfigure_abandoned_changes_nothing():
    """A reconfigure abandons a call in flight (the hooks run, the old epoch is
    aborted); the call's failure may reach the recovery only after the new world was
    adopted. It is the old world's: the group stays formed (the other ranks are in the
    new world, and forming another here would wait for them in vain) and the hooks do
    not run again. A failure of a call made in the new world still aborts it."""
    comm = Comm()
    r = Recovery(comm, 1, 3, reconfigurable=True)
    ran = []
    r.hooks[1] = lambda: ran.append(comm.epoch)
    made_in = r.generation
    r.aborted()
    comm.epoch, comm.rank, comm.world_size = 9, 0, 2
    r.adopt()
    r.failed(eccl.AbortedError("abandoned by the reconfigure"), "collective", made_in)
    assert r.state is State.FORMED and ran == [4]
    assert isinstance(r.error, eccl.AbortedError)
    r.before_call()
    assert comm.updates == 0
    r.failed(eccl.AbortedError("a call of the new world"), "collective", r.generation)
    assert r.state is State.ABORTED and ran == [4, 9]


def aborted(cls, cause):
    e = cls(cause)
    e.cause = cause
    return e


def test_a_revoked_group_refuses_calls_until_a_reconfigure_and_get_error_follows():
    """A revoke (here or arriving from another rank as RevokedError) runs the hooks once
    and refuses every call, never forming the next epoch on its own; a reconfigure's
    world ends it. get_error()'s answer is the first failure of the current world."""
    comm = Comm()
    r = Recovery(comm, 1, 3, reconfigurable=True)
    ran = []
    r.hooks[1] = lambda: ran.append(comm.epoch)
    r.revoked("revoke() on rank 1")
    assert (r.state, r.fault, ran) == (State.REVOKED, Fault.COMM_ERROR, [4])
    # The call the revoke failed here changes nothing more.
    r.failed(aborted(eccl.RevokedError, "revoked on this rank: revoke() on rank 1"),
             "collective", r.generation)
    for _ in range(2):
        with pytest.raises(eccl.RevokedError, match="reconfigure"):
            r.before_call()
    assert comm.updates == 0 and ran == [4]
    r.adopt()
    assert (r.state, r.fault) == (State.FORMED, Fault.SUCCESS)
    # Another rank's revoke, met by a call: REMOTE_ERROR, refused until a reconfigure.
    r.failed(aborted(eccl.RevokedError, "rank 2 revoked the epoch: x"), "collective",
             r.generation)
    assert (r.state, r.fault) == (State.REVOKED, Fault.REMOTE_ERROR)
    with pytest.raises(eccl.RevokedError, match="rank 2 revoked"):
        r.before_call()


@pytest.mark.parametrize("error,fault", [
    (aborted(eccl.AbortedError, "rank 0 aborted: ProcessGroup.abort() on rank 0"),
     Fault.REMOTE_ERROR),
    (aborted(eccl.AbortedError, "peer 3 lease expired"), Fault.REMOTE_ERROR),
    (aborted(eccl.AbortedError, "aborted on this rank: ProcessGroup.abort() on rank 1"),
     Fault.SUCCESS),
    (aborted(eccl.RevokedError, "revoked on this rank: x"), Fault.COMM_ERROR),
    (eccl.EcclTimeoutError("x"), Fault.TIMEOUT),
    (eccl.MismatchError("x"), Fault.COMM_ERROR),
])
def test_get_error_names_what_broke_the_world_until_the_next_one(error, fault):
    comm = Comm()
    r = Recovery(comm, 1, 3)
    r.failed(error, "collective")
    assert r.fault is fault
    # The first failure of a world is the answer; the next world starts clean.
    r.failed(eccl.EcclTimeoutError("later"), "collective")
    assert r.fault is (Fault.TIMEOUT if fault is Fault.SUCCESS else fault)
    if r.state is State.REVOKED:
        r.adopt()  # a reconfigure's world
    else:
        r.before_call()  # the next epoch, formed at the next call
    assert r.fault is Fault.SUCCESS


def test_every_call_of_the_backend_goes_through_recovery():
    """No list of calls to keep: every method torch's Backend declares that eccl's
    backend defines either recovers first or is named as not a call, and so does every
    public method of the backend (recv_anysource, the single-tensor forms, ...)."""
    from eccl.torch import ProcessGroupEccl
    from torch._C._distributed_c10d import Backend
    names = {n for n in dir(Backend) if not n.startswith("__")} | {
        n for n in vars(ProcessGroupEccl) if not n.startswith("_")}
    calls = 0
    for name in sorted(names):
        impl = vars(ProcessGroupEccl).get(name)
        if impl is None or not callable(impl):
            continue                      # torch's own, or a property
        assert getattr(impl, RECOVERING, False) or name in NOT_CALLS, name
        calls += getattr(impl, RECOVERING, False)
    # allreduce, broadcast, ..., send, recv, recv_anysource, the single-tensor forms.
    assert calls >= 25, calls
    for name in ("allreduce", "_allgather_base", "_reduce_scatter_base", "recv_anysource",
                 "alltoall_base", "barrier", "gather_single"):
        assert getattr(vars(ProcessGroupEccl)[name], RECOVERING, False), name
