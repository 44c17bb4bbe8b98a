"""zeroflat.flatten_param_group across 2 and 3 processes over gloo: the same DeepSpeed buffer on
every rank for every tier, with and without round-robin; each rank's partition and master;
training through the views; ranks that disagree on shapes; a failure on one rank."""

import copy
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import zeroflat  # noqa: E402
import zeroflat._comm  # noqa: E402  (used directly below)
from reference import Tiny, deepspeed_flat, end_rank, start_ranks, tiny_model  # noqa: E402


def check_layouts(rank, world, group):
    for round_robin in (False, True):
        for tier in ("auto", "device", "sharded", "staged", "host"):
            model = tiny_model()
            values = [p.detach().clone() for p in model.parameters() if p.requires_grad]
            want, _ = deepspeed_flat(values, world, round_robin=round_robin)
            fg = zeroflat.flatten_param_group(model.parameters(), group, tier=tier,
                                              round_robin=round_robin, verify=True)
            where = f"rank {rank} {tier} round_robin={round_robin}"
            assert fg.dp == world and fg.rank == rank, where
            assert torch.equal(fg.flat, want), where
            n = fg.layout["partition_numel"]
            assert n * world == fg.flat.numel()
            assert torch.equal(fg.partition, want[rank * n: (rank + 1) * n]), where
            assert torch.equal(fg.master, fg.partition.float()), where
            trained = [p for p in model.parameters() if p.requires_grad]
            for p, v in zip(trained, values):
                assert torch.equal(p, v), where
            rep = fg.report
            assert rep["predicted_peak_device_bytes"] == rep["measured_peak_device_bytes"], where
            if tier == "auto":
                assert fg.tier == "device", where


def check_training(rank, world, group):
    model = tiny_model(torch.float32, seed=5)
    twin = copy.deepcopy(model)
    zeroflat.flatten_param_group(model.parameters(), group, tier="sharded")
    x = torch.randint(0, 31, (3, 4), generator=torch.Generator().manual_seed(rank))
    for m in (model, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def check_disagreement(rank, world, group):
    model = Tiny(seed=0, width=13 if rank != 1 else 14).to(torch.bfloat16)
    snap = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    # Every rank names the parameter, its shape here and the other shape with a rank holding it.
    here, there = ("[31, 14]", "[31, 13]") if rank == 1 else ("[31, 13]", "[31, 14]")
    with pytest.raises(ValueError, match=re.escape(
            f"'parameter 1 {here} bf16' on this rank ({rank}), 'parameter 1 {there} bf16' on "
            f"rank {0 if rank == 1 else 1}")):
        zeroflat.flatten_param_group(model.parameters(), group)
    for p, (ptr, v) in zip(model.parameters(), snap):
        assert p.data_ptr() == ptr and torch.equal(p, v)


def check_failure_on_one_rank(rank, world, group):
    for step in (1, 4):  # before and after the originals are released
        model = tiny_model()
        values = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(zeroflat.ExecutionError, match=f"step {step}.*failed on rank 1") as e:
            zeroflat.flatten_param_group(model.parameters(), group, tier="sharded",
                                         _fault_step=step, _fault_rank=1)
        assert e.value.outcome == ("rolled back" if step == 1 else "recovered")
        for p, v in zip(model.parameters(), values):
            assert torch.equal(p, v), f"rank {rank} step {step}"


def check_errors_reach_every_rank_at_once(rank, world, group):
    """An error on one rank (its own bad group, an option only it passes) is an error on every
    rank at the same point, without anyone waiting for the process group's timeout."""
    t0 = time.monotonic()
    model = tiny_model()
    snap = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    params = list(model.parameters())
    if rank == 1:
        params[1] = params[1].detach().t().requires_grad_()  # not contiguous: this rank refuses
    with pytest.raises(ValueError, match="not contiguous" if rank == 1 else "rank 1 refused"):
        zeroflat.flatten_param_group(params, group)
    with pytest.raises(ValueError, match="different options"):
        zeroflat.flatten_param_group(model.parameters(), group,
                                     margin_bytes=1 << 20 if rank == 0 else 2 << 20)
    with pytest.raises(TypeError if rank == 2 else ValueError,
                       match="round_robin" if rank == 2 else "rank 2 refused"):
        zeroflat.flatten_param_group(model.parameters(), group,
                                     round_robin="no" if rank == 2 else False)
    for p, (ptr, v) in zip(model.parameters(), snap):
        assert p.data_ptr() == ptr and torch.equal(p, v)
    assert time.monotonic() - t0 < 60


def check_values_before_slices_change_hands(rank, world, group):
    """Ranks holding different values would each end with the owners' values under the
    sharded tier: refused on every rank, unless the caller turns the check off."""
    model = tiny_model(seed=rank)  # different values on every rank
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="different values"):
        zeroflat.flatten_param_group(model.parameters(), group, tier="sharded")
    for p, v in zip(model.parameters(), values):
        assert torch.equal(p, v)
    fg = zeroflat.flatten_param_group(model.parameters(), group, tier="sharded",
                                      check_values=False)
    assert "value_check_seconds" not in fg.report
    same = tiny_model(seed=0)
    fg = zeroflat.flatten_param_group(same.parameters(), group, tier="sharded")
    assert fg.report["value_check_seconds"] >= 0 and fg.report["value_check_bytes"] > 0


def check_shared_memory_all_gather(rank, world, group):
    """Host all-gathers between ranks of one host go through a /dev/shm window, in rounds of
    its slots, and fall back to the process group when any rank cannot map it; nothing is left
    in /dev/shm either way."""
    from zeroflat import _shm

    def pattern(r, n, salt=0):
        return ((torch.arange(n, dtype=torch.int64) * 7 + r * 13 + salt * 31) % 251).to(
            torch.uint8)

    calls = [0]

    def gathered(win, slice_bytes):
        # Each call's bytes differ from the last's, and one rank is slow to read each round
        # after its barrier while the others go on: no barrier ends an exchange, so a round
        # (of this exchange or the next) that wrote into the slots it still reads would show.
        calls[0] += 1
        buf = torch.zeros(slice_bytes * world, dtype=torch.uint8)
        buf[rank * slice_bytes: (rank + 1) * slice_bytes] = pattern(rank, slice_bytes, calls[0])
        real_barrier = _shm.dist.barrier

        def slow_barrier(*args, **kwargs):
            real_barrier(*args, **kwargs)
            time.sleep(0.03)
        if rank == calls[0] % world:
            _shm.dist.barrier = slow_barrier
        try:
            win.all_gather(buf, slice_bytes)
        finally:
            _shm.dist.barrier = real_barrier
        for r in range(world):
            assert torch.equal(buf[r * slice_bytes: (r + 1) * slice_bytes],
                               pattern(r, slice_bytes, calls[0])), f"rank {rank}: slice {r}"

    def left_behind():
        # The group's first rank makes the file and unlinks it before open() returns there.
        mine = f"zeroflat-{os.getpid()}-"
        return [n for n in os.listdir("/dev/shm") if n.startswith(mine)] if rank == 0 else []

    # Ranks of one host see each other's files: one host, and the two-step all-gather of ranks
    # on several hosts does not apply; the files are gone once every rank has looked.
    assert _shm.hosts(group, rank, world) == [0] * world
    dist.barrier()
    assert not [n for n in os.listdir("/dev/shm")
                if n.startswith(f"zeroflat-host-{os.getpid():08x}")]
    assert zeroflat._comm.hosts_of(group, rank, world) is False

    win = _shm.SharedWindow.open(group, rank, world, 1 << 20)
    assert win is not None and win.slot_bytes == 1 << 20
    gathered(win, 1 << 20)  # one round
    gathered(win, 3 * win.slot_bytes + 123)  # four rounds, both slot sets, a ragged last one
    gathered(win, 1)
    for _ in range(2 * world):  # one round each: every rank lags once after each slot set
        gathered(win, 4096)
    del win
    assert not left_behind()

    # A rank that cannot map the window: every rank falls back.
    real_map = _shm._map
    if rank == world - 1:
        def refuse(*args):
            raise OSError("not here")
        _shm._map = refuse
    try:
        assert _shm.SharedWindow.open(group, rank, world, 4096) is None
    finally:
        _shm._map = real_map
    assert not left_behind()

    # One communicator, a small gather and then a larger one: the window grows with the slices
    # rather than taking a larger buffer through the small one's slots.
    buffers = {}

    class Buffers:
        def tensor(self, ptr):
            return buffers[ptr]

    comm = zeroflat._comm.TorchComm(group, Buffers(), torch.device("cpu"))
    for n in (4096, 3 << 20):
        buf = torch.zeros(n * world, dtype=torch.uint8)
        buf[rank * n: (rank + 1) * n] = pattern(rank, n)
        buffers[buf.data_ptr()] = buf
        comm.all_gather_inplace(buf.data_ptr(), n)
        assert comm._window and comm._window.slot_bytes == _shm.slot_bytes(world, n)
        for r in range(world):
            assert torch.equal(buf[r * n: (r + 1) * n], pattern(r, n))
    # A part of every slice, through the window and through the process group: only that part
    # moves.
    n, offset, part = 3 << 20, 5000, (1 << 20) + 7
    for shm in (True, False):
        comm = zeroflat._comm.TorchComm(group, Buffers(), torch.device("cpu"))
        real_enabled = _shm.enabled
        _shm.enabled = lambda: shm
        try:
            buf = torch.zeros(n * world, dtype=torch.uint8)
            buf[rank * n: (rank + 1) * n] = pattern(rank, n)
            buffers[buf.data_ptr()] = buf
            comm.all_gather_part(buf.data_ptr(), n, offset, part)
        finally:
            _shm.enabled = real_enabled
        assert bool(comm._window) == shm
        for r in range(world):
            got = buf[r * n: (r + 1) * n]
            if r == rank:
                assert torch.equal(got, pattern(r, n))
                continue
            assert torch.equal(got[offset: offset + part], pattern(r, n)[offset: offset + part])
            assert not got[:offset].any() and not got[offset + part:].any(), f"slice {r}"
        del comm
    assert not left_behind()

    # Through the engine: the sharded tier's all-gather, with the window and without it, gives
    # DeepSpeed's buffer; the window was used (or not) as asked.
    calls = []
    real_gather = _shm.SharedWindow.all_gather

    def counted(self, buf, n, *part):
        calls.append(n)
        return real_gather(self, buf, n, *part)

    _shm.SharedWindow.all_gather = counted
    try:
        for enabled in ("1", "0"):
            os.environ["ZEROFLAT_SHM_ALLGATHER"] = enabled
            del calls[:]
            model = tiny_model()
            values = [p.detach().clone() for p in model.parameters() if p.requires_grad]
            want, _ = deepspeed_flat(values, world)
            fg = zeroflat.flatten_param_group(model.parameters(), group, tier="sharded")
            assert torch.equal(fg.flat, want), f"rank {rank}, shared memory {enabled}"
            assert bool(calls) == (enabled == "1"), calls
    finally:
        _shm.SharedWindow.all_gather = real_gather
        os.environ.pop("ZEROFLAT_SHM_ALLGATHER", None)

    if world == 3:
        # A group whose rank 0 is global rank 1: the name comes from the group's first rank.
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            win = _shm.SharedWindow.open(sub, rank - 1, 2, 8192)
            assert win is not None
            buf = torch.zeros(2 * 8192, dtype=torch.uint8)
            buf[(rank - 1) * 8192: rank * 8192] = pattern(rank, 8192)
            win.all_gather(buf, 8192)
            assert torch.equal(buf[:8192], pattern(1, 8192))
            assert torch.equal(buf[8192:], pattern(2, 8192))
        dist.barrier()


def check_a_resume_refusal_reaches_every_rank_in_its_words(rank, world, group):
    """One rank's refusal in the resume's agreement: that rank raises its own error, the others
    name it with its words (the first 245 bytes, any text)."""
    from zeroflat import _resume
    from zeroflat._comm import all_reduce_ints, failing_word

    for words in ("mp_rank_01_model_states.pt: entry 'ds_config' is bad", "é" * 300):
        mine = ValueError(words) if rank == 1 else None
        with pytest.raises(Exception) as e:
            failing = all_reduce_ints([failing_word(mine, group)], group, "max", "test", "t")
            _resume._raise_failed(failing[0], mine, group, "the model states")
        if rank == 1:
            assert e.value is mine
            continue
        assert isinstance(e.value, zeroflat.InvalidArgument), e.value
        text = str(e.value)
        assert "the model states failed on rank 1: ValueError: " in text, text
        assert text.endswith("; nothing of the engine was changed"), text
        assert words[:100] in text, text


def worker(rank, world, port):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        group = dist.group.WORLD
        check_layouts(rank, world, group)
        check_training(rank, world, group)
        check_disagreement(rank, world, group)
        check_failure_on_one_rank(rank, world, group)
        check_a_resume_refusal_reaches_every_rank_in_its_words(rank, world, group)
        if world == 3:
            check_errors_reach_every_rank_at_once(rank, world, group)
        check_values_before_slices_change_hands(rank, world, group)
        check_shared_memory_all_gather(rank, world, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks(world):
    start_ranks(worker, world)


def hosts_worker(rank, world, port):
    """Four ranks as two pretended hosts whose ranks interleave ({0, 3} and {1, 2}): the
    two-step all-gather puts every slice in its place whatever the order of the hosts."""
    from zeroflat import _comm

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        members = [[0, 3], [1, 2]]
        host = 0 if rank in (0, 3) else 1
        local = members[host].index(rank)
        host_groups = [dist.new_group(m, backend="gloo") for m in members]
        across = [dist.new_group(sorted(m[c] for m in members), backend="gloo")
                  for c in range(2)]
        hosts = _comm._Hosts(members, host, local, host_groups[host], across[local])
        from zeroflat import _shm

        # One window, opened for the largest slice, serves every gather after it.
        window = hosts.open_window(5 << 20)
        assert window is not None
        for n in (4096, 5 << 20):
            buf = torch.zeros(n * world, dtype=torch.uint8)
            mine = ((torch.arange(n, dtype=torch.int64) * 7 + rank * 13) % 251).to(torch.uint8)
            buf[rank * n: (rank + 1) * n] = mine
            hosts.all_gather(buf, n, window)
            for r in range(world):
                want = ((torch.arange(n, dtype=torch.int64) * 7 + r * 13) % 251).to(torch.uint8)
                assert torch.equal(buf[r * n: (r + 1) * n], want), f"rank {rank}: slice {r}"
        # A part of every slice: only those bytes move, each into its place.
        n, offset, part = 1 << 20, 4096 * 3, 70000
        buf = torch.zeros(n * world, dtype=torch.uint8)
        buf[rank * n: (rank + 1) * n] = 1 + rank
        hosts.all_gather(buf, n, window, offset, part)
        for r in range(world):
            got = buf[r * n: (r + 1) * n]
            if r != rank:
                assert bool((got[offset: offset + part] == 1 + r).all()), f"rank {rank}: {r}"
                assert int(got.count_nonzero()) == part, f"rank {rank}: slice {r}"
        del window

        # Through a communicator over the world, whose hosts are these: a load's parts, one
        # after the other, go through one window, opened at the first.
        buffers = {}

        class Buffers:
            def tensor(self, ptr):
                return buffers[ptr]

        key = tuple(range(world))
        _comm._hosts_of_group[key] = (dist.group.WORLD, _comm._Hosts(
            members, host, local, host_groups[host], across[local]))
        opened = []
        real_open = _shm.SharedWindow.open

        def counted(*a, **k):
            opened.append(a[-1])
            return real_open(*a, **k)

        _shm.SharedWindow.open = counted
        try:
            comm = _comm.TorchComm(dist.group.WORLD, Buffers(), torch.device("cpu"))
            n = 3 << 20
            buf = torch.zeros(n * world, dtype=torch.uint8)
            buf[rank * n: (rank + 1) * n] = (
                (torch.arange(n, dtype=torch.int64) + rank * 31) % 253).to(torch.uint8)
            buffers[buf.data_ptr()] = buf
            bounds = [0, 1 << 20, 2 << 20, (2 << 20) + 300000, n]
            for a, b in zip(bounds, bounds[1:]):
                comm.all_gather_part(buf.data_ptr(), n, a, b - a)
            assert len(opened) == 1, opened
            for r in range(world):
                want = ((torch.arange(n, dtype=torch.int64) + r * 31) % 253).to(torch.uint8)
                assert torch.equal(buf[r * n: (r + 1) * n], want), f"rank {rank}: slice {r}"
            del comm
        finally:
            _shm.SharedWindow.open = real_open
            _comm._hosts_of_group.pop(key, None)

        # A rank of one host cannot map the window: every rank learns it, nothing moves (the
        # caller then takes the group's own all-gather).
        real_map = _shm._map
        if rank == 3:
            def refuse(*args):
                raise OSError("no room")
            _shm._map = refuse
        try:
            assert hosts.open_window(4096) is None
        finally:
            _shm._map = real_map
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def test_two_step_all_gather_puts_every_slice_in_place_whatever_the_host_order():
    start_ranks(hosts_worker, 4)
