"""Which path the torch backend takes for CUDA tensors, and what it hands the same-host
calls, checked without a GPU: `eccl.torch_cuda.ipc_works` with a recording communicator
and CPU tensors standing in for CUDA ones (the GPU check runs the real thing)."""

import contextlib
import re

import pytest

torch = pytest.importorskip("torch")
import eccl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from eccl import torch_cuda  # noqa: E402


class Comm:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return name
        return record


class Backend:
    def __init__(self, world, rank):
        self.comm, self.world, self.r = Comm(), world, rank

    def size(self):
        return self.world

    def rank(self):
        return self.r


@pytest.fixture(autouse=True)
def _no_streams(monkeypatch):
    """The wait for the tensors' streams (an event per device) is recorded as a call of
    its own, with the tensors it covers."""
    def after_streams(comm, ts):
        comm.calls.append(("await", tuple(ts), {}))
        return ["await"]
    monkeypatch.setattr(torch_cuda, "after_streams", after_streams)


def device_calls(comm, covering):
    """The calls after the stream wait, which must come first and cover `covering`."""
    assert comm.calls[0][0] == "await", comm.calls
    assert {t.data_ptr() for t in comm.calls[0][1]} == {t.data_ptr() for t in covering}
    return comm.calls[1:]


def opts(**kw):
    import types
    return types.SimpleNamespace(**kw)


def test_all_gather_hands_over_input_output_and_the_input_count():
    b = Backend(3, 1)
    out, inp = torch.zeros(12), torch.ones(4)
    works, result = torch_cuda.ipc_works(b, "_allgather_base", (out, inp, None))
    assert works == ["await", "all_gather_device"] and result == [out]
    name, args, kw = device_calls(b.comm, [out, inp])[0]
    assert args == (inp.data_ptr(), out.data_ptr(), 4, "torch.float32")
    assert kw["owner"] == (out, inp) and kw["async_op"] is True
    # NCCL's in-place form goes the same way (the Rust side accepts the own slice).
    b = Backend(3, 1)
    torch_cuda.ipc_works(b, "allgather_into_tensor_coalesced", ([out], [out[4:8]], None))
    assert b.comm.calls[1][1][:3] == (out[4:8].data_ptr(), out.data_ptr(), 4)


def test_reduce_scatter_hands_over_the_op_and_the_output_count():
    b = Backend(2, 0)
    out, inp = torch.zeros(5, dtype=torch.bfloat16), torch.ones(10, dtype=torch.bfloat16)
    works, _ = torch_cuda.ipc_works(
        b, "_reduce_scatter_base", (out, inp, opts(reduceOp=dist.ReduceOp.MAX)))
    name, args, _ = device_calls(b.comm, [out, inp])[0]
    assert name == "reduce_scatter_device"
    assert args == (inp.data_ptr(), out.data_ptr(), 5, "torch.bfloat16", eccl.ReduceOp.MAX)
    b = Backend(2, 0)
    torch_cuda.ipc_works(b, "reduce_scatter_tensor_coalesced", ([out], [inp]))
    assert b.comm.calls[1][1][4] == eccl.ReduceOp.SUM     # no options: sum


def test_broadcast_hands_over_the_root():
    b = Backend(4, 2)
    ts = [torch.zeros(7, dtype=torch.int64)]
    works, result = torch_cuda.ipc_works(b, "broadcast", (ts, opts(rootRank=3)))
    assert result is ts and works == ["await", "broadcast_device"]
    assert device_calls(b.comm, ts)[0][1] == (ts[0].data_ptr(), 7, "torch.int64", 3)


def test_all_to_all_hands_over_every_blocks_element_count():
    # Equal splits (torch passes none): 3 blocks of 2 rows of 5.
    b = Backend(3, 0)
    out, inp = torch.zeros(6, 5), torch.ones(6, 5)
    works, result = torch_cuda.ipc_works(b, "alltoall_base", (out, inp, [], [], None))
    assert works == ["await", "all_to_all_device"] and result is out
    name, args, kw = device_calls(b.comm, [out, inp])[0]
    assert args == (inp.data_ptr(), out.data_ptr(), [10, 10, 10], [10, 10, 10],
                    "torch.float32")
    assert all(a is b_ for a, b_ in zip(kw["owner"], (out, inp, out, inp)))
    # Uneven splits, as an MoE layer passes them: rows times the row's elements.
    b = Backend(3, 2)
    out, inp = torch.zeros(4, 2), torch.ones(5, 2)
    torch_cuda.ipc_works(b, "alltoall_base", (out, inp, [0, 3, 1], [2, 0, 3], None))
    assert device_calls(b.comm, [out, inp])[0][1][2:4] == ([4, 0, 6], [0, 6, 2])


@pytest.mark.parametrize("others", ["expect nothing", "expect a block"])
def test_a_rank_whose_all_to_all_is_wrong_joins_the_device_call_moving_nothing(others):
    """Splits that do not cover the tensor, an uneven tensor without splits, an output
    of another dtype: the rank is in the device call all the same (the others, whose
    dtypes are its own, are there), with no buffers and zero counts, and then raises a
    MismatchError saying what is wrong; where the others' check of the counts failed the
    call, that failure is the cause and reaches the recovery."""
    class Work:
        def wait(self):
            if others == "expect a block":
                raise eccl.MismatchError("all_to_all: rank 1 sends 0 elements to rank 0")

    class Recovery:
        def __init__(self):
            self.failures = []

        def failed(self, e, kind):
            self.failures.append((type(e).__name__, kind))

    for o, i, os_, is_, says in [
            (torch.zeros(4), torch.ones(4), [], [1, 1, 1], "input_split_sizes [1, 1, 1]"),
            (torch.zeros(4), torch.ones(4), [], [], "(none: equal blocks)"),
            (torch.zeros(6), torch.ones(6), [3, 3], [], "output_split_sizes [3, 3]"),
            (torch.zeros(6, dtype=torch.float64), torch.ones(6), [], [], "output is torch.float64")]:
        b = Backend(3, 1)
        b.comm.all_to_all_device = lambda *a, **kw: (b.comm.calls.append(a), Work())[1]
        b._recovery = Recovery()
        with pytest.raises(eccl.MismatchError, match="this rank cannot take part") as e:
            torch_cuda.ipc_works(b, "alltoall_base", (o, i, os_, is_, None))
        assert says in str(e.value), (says, str(e.value))
        assert b.comm.calls == [(0, 0, [0, 0, 0], [0, 0, 0], "torch.float32")]
        if others == "expect a block":
            assert isinstance(e.value.__cause__, eccl.MismatchError)
            assert b._recovery.failures == [("MismatchError", "collective")]
        else:
            assert e.value.__cause__ is None and b._recovery.failures == []


def test_gather_and_scatter_go_through_one_flat_device_buffer_on_the_root():
    # Gather at the root: the blocks come back through a flat buffer, copied out after.
    b = Backend(3, 1)
    mine, blocks = torch.full((2, 2), 7.0), [torch.zeros(2, 2) for _ in range(3)]
    works, result, after = torch_cuda.ipc_works(b, "gather", ([blocks], [mine], opts(rootRank=1)))
    name, args, kw = b.comm.calls[1]
    assert name == "gather_device" and args[0] == mine.data_ptr() and args[2:] == (
        4, "torch.float32", 1)
    flat = kw["owner"][2]
    assert args[1] == flat.data_ptr() and flat.shape == (3, 2, 2)
    flat.copy_(torch.arange(12.0).view(3, 2, 2))
    with pytest.MonkeyPatch.context() as m:   # the copies' stream sync, without a GPU
        m.setattr(torch.cuda, "current_stream", lambda d: opts(synchronize=lambda: None))
        after()
    assert [b_.flatten().tolist() for b_ in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                        [8, 9, 10, 11]]
    # Off the root a gather has no output: address 0, and nothing to copy.
    b = Backend(3, 0)
    got = torch_cuda.ipc_works(b, "gather", ([], [mine], opts(rootRank=1)))
    assert len(got) == 2 and b.comm.calls[1][1][1] == 0
    # Scatter from the root: its blocks stacked into one flat input.
    b = Backend(2, 0)
    out, blocks = torch.zeros(3), [torch.full((3,), float(i)) for i in range(2)]
    torch_cuda.ipc_works(b, "scatter", ([out], [blocks], opts(rootRank=0)))
    name, args, kw = b.comm.calls[1]
    assert name == "scatter_device" and args[1:] == (out.data_ptr(), 3, "torch.float32", 0)
    assert kw["owner"][2].tolist() == [[0, 0, 0], [1, 1, 1]]
    # Blocks of another shape but the same size go through the flat buffer too; blocks
    # of another size leave the root without a buffer (address 0), which eccl refuses on
    # every rank alike: the other ranks, which cannot see the root's blocks, take the
    # same path and fail with it instead of waiting for a root that went another way.
    b = Backend(2, 0)
    odd = [torch.zeros(1, 3), torch.ones(3, 1)]
    torch_cuda.ipc_works(b, "scatter", ([out], [odd], opts(rootRank=0)))
    assert b.comm.calls[1][2]["owner"][2].tolist() == [[0, 0, 0], [1, 1, 1]]
    b = Backend(2, 0)
    bad = [torch.zeros(3), torch.zeros(4)]
    torch_cuda.ipc_works(b, "scatter", ([out], [bad], opts(rootRank=0)))
    assert b.comm.calls[1][0] == "scatter_device" and b.comm.calls[1][1][0] == 0
    b = Backend(2, 1)
    torch_cuda.ipc_works(b, "gather", ([bad[:1]], [torch.zeros(3)], opts(rootRank=1)))
    assert b.comm.calls[1][0] == "gather_device" and b.comm.calls[1][1][1] == 0


def test_a_non_contiguous_all_to_all_goes_the_same_way_through_contiguous_copies():
    b = Backend(2, 0)
    out, inp = torch.zeros(4, 6)[:, ::2], torch.arange(24.0).view(4, 6)[:, ::2]
    works, result, copy_back = torch_cuda.ipc_works(b, "alltoall_base",
                                                    (out, inp, [], [], None))
    name, args, kw = b.comm.calls[1]
    sent, written = kw["owner"][3], kw["owner"][2]
    assert name == "all_to_all_device" and result is out
    assert args[0] == sent.data_ptr() and sent.is_contiguous() and torch.equal(sent, inp)
    assert args[1] == written.data_ptr() and written.is_contiguous()
    written.fill_(5.0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_stream", lambda d: opts(synchronize=lambda: None))
        copy_back()
    assert bool((out == 5.0).all())


@pytest.mark.parametrize("case", ["shape", "dtype", "bool", "mixed dtypes"])
def test_calls_that_do_not_fit_are_staged(case):
    b = Backend(2, 0)
    out, inp = torch.zeros(8), torch.ones(4)
    if case == "shape":
        out = torch.zeros(9)
    elif case == "dtype":
        out, inp = out.to(torch.int16), inp.to(torch.int16)
    elif case == "bool":
        out, inp = out.bool(), inp.bool()
    else:
        inp = inp.double()
    assert torch_cuda.ipc_works(b, "_allgather_base", (out, inp, None)) is None
    assert b.comm.calls == []


def test_non_contiguous_all_gather_and_reduce_scatter_go_through_contiguous_copies():
    """A layout is one rank's own, so it does not change the path (every rank takes the
    device path alike): a non-contiguous input is copied to a contiguous one before the
    call, a non-contiguous output is written through a contiguous buffer and copied back
    before the Work completes."""
    b = Backend(2, 0)
    out, inp = torch.zeros(16)[::2], torch.arange(8.0)[::2]
    works, result, copy_back = torch_cuda.ipc_works(b, "_allgather_base", (out, inp, None))
    name, args, kw = b.comm.calls[1]
    written, sent = kw["owner"]
    assert name == "all_gather_device" and result == [out]
    assert sent.is_contiguous() and torch.equal(sent, inp) and args[0] == sent.data_ptr()
    assert written.is_contiguous() and args[1] == written.data_ptr() and args[2] == 4
    written.fill_(2.0)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_stream", lambda d: opts(synchronize=lambda: None))
        copy_back()
    assert bool((out == 2.0).all())
    # reduce_scatter with contiguous tensors: no copies, nothing to copy back.
    b = Backend(2, 0)
    out, inp = torch.zeros(4), torch.ones(8)
    got = torch_cuda.ipc_works(b, "_reduce_scatter_base", (out, inp, None))
    assert len(got) == 2 and b.comm.calls[1][2]["owner"] == (out, inp)


def test_a_non_contiguous_broadcast_goes_through_a_contiguous_copy():
    b = Backend(2, 1)
    t = torch.arange(16.0).view(4, 4).t()
    works, result, copy_back = torch_cuda.ipc_works(b, "broadcast", ([t], opts(rootRank=0)))
    name, args, kw = b.comm.calls[1]
    flat = kw["owner"]
    assert name == "broadcast_device" and flat.is_contiguous() and torch.equal(flat, t)
    assert args[0] == flat.data_ptr() and args[3] == 0 and result == [t]
    flat.fill_(4.0)
    copy_back()
    assert bool((t == 4.0).all())
    # At the root, whose tensor the call never writes, nothing is copied back.
    root = Backend(2, 0)
    got = torch_cuda.ipc_works(root, "broadcast", ([t], opts(rootRank=0)))
    assert len(got) == 2 and root.comm.calls[1][0] == "broadcast_device"


def test_a_staged_calls_waits_for_its_copies_go_first_in_its_work():
    """The waits queued for a staged call's copies to host (`STAGING.waits`) go first in
    the Work of the call submitted next, so a failed wait is that Work's error, and they
    are taken once."""
    from eccl import torch_work

    class FakeWork:
        def __init__(self, name):
            self.name = name

        def add_done_callback(self, fn, errors_only=False):
            pass

        def is_completed(self):
            return False

    calls = torch_work._Calls()
    torch_cuda.STAGING.active = True
    torch_cuda.STAGING.waits = [FakeWork("wait")]
    try:
        work = calls.submit([FakeWork("call")], None)
        again = calls.submit([FakeWork("next")], None)
    finally:
        torch_cuda.STAGING.active = False
        torch_cuda.STAGING.waits = []
    assert [w.name for w in work._works] == ["wait", "call"]
    assert [w.name for w in again._works] == ["next"]


def test_every_rank_takes_the_device_all_reduce_from_what_ranks_share():
    """all_reduce goes to eccl's device call (IPC on one host, the staged pipeline
    elsewhere) by the tensors' dtypes and device alone, which every rank of a correct
    call has alike; a layout does not change the path."""
    ok = torch_cuda._device_all_reduce_ok
    assert ok([torch.zeros(8)]) and ok([torch.zeros(4, 4).t()])
    assert ok([torch.zeros(8, dtype=torch.bfloat16), torch.zeros(2)])
    assert not ok([]) and not ok([torch.zeros(8, dtype=torch.bool)])
    assert not ok([torch.zeros(8, dtype=torch.int16)])
    assert not ok([torch.zeros(8), torch.zeros(8, device="meta")])


def test_a_non_contiguous_all_reduce_goes_through_a_contiguous_copy():
    """A non-contiguous tensor's all_reduce hands the device call a contiguous copy and
    writes the result back into the tensor once the call is done."""
    import types

    from eccl.torch import ProcessGroupEccl

    submitted = []
    fake = types.SimpleNamespace(
        comm=Comm(), _calls=types.SimpleNamespace(submit=lambda *a: submitted.append(a)))
    t = torch.arange(16.0).view(4, 4).t()
    ProcessGroupEccl._all_reduce_cuda(fake, [t], None)
    name, args, kw = fake.comm.calls[1]
    copy = kw["owner"]
    assert name == "all_reduce_device" and copy.is_contiguous() and torch.equal(copy, t)
    assert args[0] == copy.data_ptr() and args[1] == 16 and copy.data_ptr() != t.data_ptr()
    (works, result, after), = submitted
    assert result == [t] and after is not None
    copy.fill_(3.0)
    after()
    assert bool((t == 3.0).all())
    # A contiguous tensor goes as it is, with nothing to copy back.
    submitted.clear()
    u = torch.zeros(8)
    fake.comm.calls.clear()
    ProcessGroupEccl._all_reduce_cuda(fake, [u], None)
    assert fake.comm.calls[1][2]["owner"] is u and submitted[0][2] is None


@contextlib.contextmanager
def _no_gpu_sync():
    """The copy-out steps wait for the current stream: without a GPU, nothing to wait for."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_stream", lambda d: opts(synchronize=lambda: None))
        yield


def test_the_list_forms_go_through_one_flat_device_buffer_each():
    # all_gather into a list: one flat output per input, its rows copied out after.
    b = Backend(3, 1)
    inp = torch.full((2, 2), 7.0)
    outs = [torch.zeros(2, 2), torch.zeros(4), torch.zeros(1, 4)]   # shapes of one size
    works, result, after = torch_cuda.ipc_works(b, "allgather", ([outs], [inp], None))
    assert works == ["await", "all_gather_device"] and result == [outs]
    flat, sent = b.comm.calls[1][2]["owner"]
    name, args, kw = device_calls(b.comm, [flat, sent])[0]
    assert args == (sent.data_ptr(), flat.data_ptr(), 4, "torch.float32")
    assert flat.shape == (3, 2, 2) and torch.equal(sent, inp)
    flat.copy_(torch.arange(12.0).view(3, 2, 2))
    with _no_gpu_sync():
        after()
    assert [o.flatten().tolist() for o in outs] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                    [8, 9, 10, 11]]
    # reduce_scatter from a list: the blocks concatenated before the call, the op kept.
    b = Backend(2, 0)
    out = torch.zeros(3, dtype=torch.bfloat16)
    blocks = [torch.full((3,), float(i), dtype=torch.bfloat16) for i in range(2)]
    works, result = torch_cuda.ipc_works(
        b, "reduce_scatter", ([out], [blocks], opts(reduceOp=dist.ReduceOp.MIN)))
    name, args, kw = b.comm.calls[1]
    flat = kw["owner"][2]
    assert name == "reduce_scatter_device" and result == [out]
    assert args == (flat.data_ptr(), out.data_ptr(), 3, "torch.bfloat16", eccl.ReduceOp.MIN)
    assert flat.tolist() == [0, 0, 0, 1, 1, 1]
    assert {t.data_ptr() for t in b.comm.calls[0][1]} == {out.data_ptr(), flat.data_ptr()}
    # all_to_all of lists, blocks of any sizes: every block's element count goes to eccl.
    b = Backend(3, 2)
    ins = [torch.full((n,), float(n)) for n in (1, 0, 2)]
    outs = [torch.zeros(2), torch.zeros(3, 1), torch.zeros(0)]
    works, result, after = torch_cuda.ipc_works(b, "alltoall", (outs, ins, None))
    name, args, kw = b.comm.calls[1]
    flat_out, flat_in = kw["owner"]
    assert name == "all_to_all_device" and result == outs
    assert args == (flat_in.data_ptr(), flat_out.data_ptr(), [1, 0, 2], [2, 3, 0],
                    "torch.float32")
    assert flat_in.tolist() == [1, 2, 2] and flat_out.numel() == 5
    flat_out.copy_(torch.arange(5.0))
    with _no_gpu_sync():
        after()
    assert [o.flatten().tolist() for o in outs] == [[0, 1], [2, 3, 4], []]


@pytest.mark.parametrize("case", ["short list", "block size", "block dtype"])
def test_a_rank_whose_list_form_blocks_do_not_fit_joins_the_device_call_moving_nothing(case):
    """As the CPU path does: the rank is in the others' device call with no buffer and
    a count of zero (their check of the calls' records fails it on every rank, naming
    this one), then raises saying what is wrong."""
    class Work:
        def wait(self):
            raise eccl.MismatchError("rank 1 asked for AllGather of 0, rank 0 for 4")

    class Recovery:
        failures: list = []

        def failed(self, e, kind):
            self.failures.append((type(e).__name__, kind))

    inp, outs = torch.ones(4), [torch.zeros(4), torch.zeros(4)]
    rs_out, rs_in = torch.zeros(4), [torch.ones(4), torch.ones(4)]
    a2a_in = [torch.ones(4), torch.ones(4)]
    if case == "short list":
        outs, rs_in, a2a_in = outs[:1], rs_in[:1], a2a_in[:1]
    elif case == "block size":
        outs[1], rs_in[1] = torch.zeros(5), torch.ones(5)
    else:
        outs[1], rs_in[1], a2a_in[1] = outs[1].double(), rs_in[1].double(), a2a_in[1].double()
    for call, args, err, says in [
            ("allgather", ([outs], [inp], None), eccl.InvalidArgumentError,
             "all_gather: output blocks do not fit"),
            ("reduce_scatter", ([rs_out], [rs_in], None), eccl.InvalidArgumentError,
             "reduce_scatter: input blocks do not fit"),
            ("alltoall", ([torch.zeros(4), torch.zeros(4)], a2a_in, None), eccl.MismatchError,
             "all_to_all: this rank (0) cannot take part")]:
        if call == "alltoall" and case == "block size":
            continue      # all_to_all's blocks may differ in size
        b = Backend(2, 0)
        b._recovery = Recovery()
        joined = []
        for device_call in ("all_gather_device", "reduce_scatter_device", "all_to_all_device"):
            setattr(b.comm, device_call,
                    lambda *a, _n=device_call, **kw: (joined.append((_n, a)), Work())[1])
        with pytest.raises(err, match=re.escape(says)) as e:
            torch_cuda.ipc_works(b, call, args)
        assert isinstance(e.value.__cause__, eccl.MismatchError)
        ((name, a),) = joined
        assert a[:3] == (0, 0, 0) or a[:4] == (0, 0, [0, 0], [0, 0]), (name, a)
        assert b.comm.calls == []      # nothing else was called


def test_a_premultiplied_list_reduce_scatter_is_staged():
    b = Backend(2, 0)
    o = opts(reduceOp=dist._make_nccl_premul_sum(2.0))
    assert torch_cuda.ipc_works(
        b, "reduce_scatter", ([torch.zeros(4)], [[torch.ones(4), torch.ones(4)]], o)) is None
    assert b.comm.calls == []


def test_send_and_recv_go_to_eccls_device_calls_after_the_stream():
    b = Backend(2, 0)
    t = torch.arange(6.0).view(2, 3)
    works, result = torch_cuda.p2p_works(b, "send", ([t], 1, 7))
    assert works == ["await", "send_device"] and result == [t]
    name, args, kw = device_calls(b.comm, [t])[0]
    assert args == (t.data_ptr(), 6, "torch.float32", 1, 7) and kw["async_op"] is True
    # A non-contiguous receive goes through a contiguous buffer, copied back after.
    b = Backend(2, 1)
    out = torch.zeros(4, 2, dtype=torch.int64)[:, 0]
    works, result, back = torch_cuda.p2p_works(b, "recv", ([out], 0, 3))
    name, args, kw = b.comm.calls[1]
    buf = kw["owner"][1]
    assert name == "recv_device" and args == (buf.data_ptr(), 4, "torch.int64", 0, 3)
    assert buf.is_contiguous() and buf.data_ptr() != out.data_ptr()
    buf.copy_(torch.tensor([5, 6, 7, 8]))
    with _no_gpu_sync():
        back()
    assert out.tolist() == [5, 6, 7, 8]
