"""Two simulated nodes on this machine (scripts/nodes.py: a mount namespace, a copy of the
checkpoint and a block-I/O cgroup per node), cold, with the kernel's count of the bytes each node
read from the disk: with zeroflat.hf.from_pretrained each node reads its half of the checkpoint
(and 2 MiB at most besides: headers, and the sampled check of the other node's copy); with
Transformers'
from_pretrained (every parameter touched, as DeepSpeed's flatten touches them) each node reads
all of it. And the harness leaves nothing behind: no cgroup, no mount, no copy, no process, after
a run that succeeds, fails, times out or is stopped by SIGTERM.

It also checks that options out of range (--timeout -1, nan or inf, a CPU quota of nan, a
bandwidth under 1 byte/s per node, ...) are usage errors before anything is set up: those checks
need no root and take seconds.

The rest needs root and a block-I/O cgroup controller. Where they are missing the harness refuses
(exit 77, one line saying why) and those tests skip with that line; run as a script (as ctest
does) the suite then exits 77 once the checks that need no root have passed.

    python test_nodes.py                      # the suite (exit 77: skipped, reason printed)
    python test_nodes.py --rank WAY           # one rank, under the harness"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HARNESS = os.path.join(ROOT, "scripts", "nodes.py")
RESULT = "NODES_TEST "
MiB = 1 << 20


def harness(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, HARNESS, *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def unsupported_reason():
    """None where the harness can rehearse nodes here, else its one-line refusal."""
    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "ck"))
        with open(os.path.join(d, "ck", "f"), "wb") as f:
            f.write(b"x" * 4096)
        r = harness("--nodes", "1", "--checkpoint", os.path.join(d, "ck"), "--copies-in", d,
                    "--quiet", "--", "true")
    if r.returncode == 77:
        return r.stderr.strip().splitlines()[-1]
    assert r.returncode == 0, r.stdout + r.stderr
    return None


# --- the rank program --------------------------------------------------------------------------

def resident_bytes(directory):
    """Bytes of the files in `directory` now in the page cache (mincore over a mapping of each):
    after a cold start, what this node read of them from the disk, read-ahead included, and
    nothing of any other file."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    total = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            try:
                assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += sum(b & 1 for b in vec.raw) * page
    return total


def rank_main(way):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import zeroflat.hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path = os.environ["NODES_CHECKPOINT"]
    if way == "warm":
        # Both ways once, alone, on the original checkpoint: every library the ranks read is in
        # the page cache before the nodes' disk reads are counted (a node's count is of the whole
        # disk, so a library read from it would count as the checkpoint's).
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                    device="cpu", param_groups=None)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        sum(float(p.detach().float().sum()) for p in model.parameters())
        resident_bytes(path)
        dist.destroy_process_group()
        return 0
    if way == "zeroflat":
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                            device="cpu", param_groups=None)
        loader_bytes = sum(fg.report["bytes_read"] for fg in model.zeroflat_groups)
        parts = max(fg.report["gather_parts"] for fg in model.zeroflat_groups)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        loader_bytes = parts = None
    # Every parameter touched, as DeepSpeed's flatten would: Transformers leaves parameters as
    # mappings of the files, read when first touched.
    total = sum(float(p.detach().float().sum()) for p in model.parameters())
    dist.barrier()
    print(RESULT + json.dumps({"rank": dist.get_rank(), "loader_bytes": loader_bytes,
                               "gather_parts": parts, "checksum": total,
                               "resident": resident_bytes(path)}), flush=True)
    dist.destroy_process_group()
    return 0


# --- the tests ---------------------------------------------------------------------------------

if __name__ != "__main__" or sys.argv[1:2] != ["--rank"]:
    import pytest

    @pytest.fixture(scope="module")
    def rehearsable():
        reason = unsupported_reason()
        if reason:
            pytest.skip(reason)

    @pytest.fixture(scope="module")
    def checkpoint(rehearsable, tmp_path_factory):
        """A Llama-shaped model of 53 M parameters, 106 MB bf16 in four shards, written by
        Transformers' save_pretrained."""
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        import zeroflat.hf  # noqa: F401  (what the ranks import is in the page cache: the
        # nodes' counts are the checkpoint's)

        path = str(tmp_path_factory.mktemp("nodes") / "checkpoint")
        config = LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2048,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path, max_shard_size="30MB")
        env = dict(os.environ, NODES_CHECKPOINT=path, MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(harness_module().free_port()), RANK="0", WORLD_SIZE="1")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--rank", "warm"], env=env,
                       check=True, timeout=300)
        return path

    def run_nodes(checkpoint, way, tmp_path, *extra, ranks_per_node=1):
        r = harness("--nodes", "2", "--ranks-per-node", str(ranks_per_node), "--cold",
                    "--checkpoint", checkpoint, "--copies-in", str(tmp_path), "--timeout", "100",
                    "--json", *extra, "--",
                    sys.executable, os.path.abspath(__file__), "--rank", way, timeout=150)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        res = json.loads(r.stdout)
        ranks = [json.loads(ln[len(RESULT):]) for n in res["per_node"] for e in n["ranks"]
                 for ln in e["stdout"].splitlines() if ln.startswith(RESULT)]
        assert len(ranks) == 2 * ranks_per_node, res
        return res, ranks

    def test_each_node_reads_its_share_with_zeroflat_and_all_of_it_with_transformers(
            checkpoint, tmp_path):
        size = sum(os.path.getsize(os.path.join(checkpoint, n)) for n in os.listdir(checkpoint))
        res, ranks = run_nodes(checkpoint, "zeroflat", tmp_path)
        assert res["checkpoint_bytes"] == size
        # What each node holds of its copy after the load (the page cache, cold before): its
        # half, 1 MiB for headers and page alignment, and the check of the other node's copy (at
        # most 1 MiB of its bytes, sampled). No read-ahead: the loader turns the kernel's off and
        # asks for exactly its pieces (ZEROFLAT_READ_AHEAD=exact, the default), where the
        # kernel's would read up to two windows of the disk's read_ahead_kb past each point where
        # a node's reads stop in the middle of a file (8 MiB windows on some virtual disks).
        slack = 2 * MiB
        for node, rank in zip(res["per_node"], ranks):
            assert rank["resident"] <= size / 2 + slack, (node["node"], rank, size / 2, slack)
            # The kernel's count of the node's disk reads: that, and what else its processes
            # read that the page cache did not hold (libraries: a few MiB at most).
            disk = node["disk_read_bytes"]
            assert disk <= size / 2 + slack + 8 * MiB, (node["node"], disk, size / 2, slack)
            # Cold and counted: the node read at least what its loader says it read.
            assert disk >= rank["loader_bytes"] >= 0.45 * size, (disk, rank, size)
            assert rank["resident"] >= rank["loader_bytes"], rank
        assert ranks[0]["checksum"] == ranks[1]["checksum"]

        res_t, ranks_t = run_nodes(checkpoint, "transformers", tmp_path)
        for node, rank in zip(res_t["per_node"], ranks_t):
            assert node["disk_read_bytes"] >= 0.9 * size, (node["node"], node, size)
            assert rank["resident"] >= 0.9 * size, rank
        assert ranks_t[0]["checksum"] == ranks[0]["checksum"]  # the same model both ways
        assert res_t["x_checkpoint"] >= 1.8
        assert res["x_checkpoint"] <= 1.0 + 2 * (slack + 8 * MiB) / size

    def interfaces(pid):
        """The network interfaces a harness of process pid made that are still there."""
        return [n for n in os.listdir("/sys/class/net") if re.fullmatch(rf"zfn{pid}\D.*", n)]

    def test_only_other_nodes_bytes_cross_the_shaped_link(checkpoint, tmp_path):
        """2 nodes x 2 ranks, each node in a network namespace of its own behind a 1 Gbit/s link:
        the ranks of a node read its half (a quarter each), and each node receives the other
        node's half over its link once; the ranks of a node complete one another's buffers in
        shared memory, part by part while they read. A flat all-gather of the four ranks would
        bring each node 3/4 of it."""
        r = harness("--check-link", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        size = sum(os.path.getsize(os.path.join(checkpoint, n)) for n in os.listdir(checkpoint))
        res, ranks = run_nodes(checkpoint, "zeroflat", tmp_path, "--link", "1Gbit/s",
                               ranks_per_node=2)
        assert res["link_bytes_per_s"] == 125_000_000
        for i, node in enumerate(res["per_node"]):
            got = node["link_received_bytes"]
            # The other node's half, and TCP's and the agreements' bytes besides (a few %).
            assert 0.49 * size <= got <= 0.58 * size, (node["node"], got, size)
            # What the node holds of its copy (cold before): its half, and 2 MiB per rank of
            # headers and page alignment (each rank's quarter ends in pages it shares with the
            # next). The kernel's count of the node's disk reads adds whatever else its two
            # processes read that the page cache did not hold (libraries, up to 8 MiB each on a
            # machine whose other work evicted them).
            for rank in ranks[2 * i:2 * i + 2]:
                assert rank["resident"] <= size / 2 + 2 * 2 * MiB, (node["node"], rank, size)
            assert node["disk_read_bytes"] <= size / 2 + 2 * MiB + 2 * 8 * MiB, node
        assert len({rank["checksum"] for rank in ranks}) == 1, ranks
        # Each rank's 26 MB slice read in parts, each gathered while the next was read.
        assert all(rank["gather_parts"] == 3 for rank in ranks), ranks
        assert not [n for n in os.listdir("/sys/class/net") if n.startswith("zfn")]

    def sleepers():
        """The processes running the tests' `sleep 97.125`."""
        found = []
        for proc in os.listdir("/proc"):
            try:
                with open(f"/proc/{proc}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:2] == [b"sleep", b"97.125"]:
                        found.append(proc)
            except (OSError, NotADirectoryError):
                pass
        return found

    def leftovers(pid, copies_in, mount):
        """What a harness of process pid left: cgroups named after it, copies in copies_in,
        mounts of its copies seen by any process, processes still running the marker."""
        found = []
        for root in ("/sys/fs/cgroup/blkio", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
            if os.path.isdir(root):
                found += [os.path.join(root, n) for n in os.listdir(root)
                          if n.startswith(f"zeroflat-nodes-{pid}-")]
        found += [os.path.join(copies_in, n) for n in os.listdir(copies_in)]
        for proc in os.listdir("/proc"):
            if not proc.isdigit():
                continue
            try:
                with open(f"/proc/{proc}/mountinfo") as f:
                    text = f.read()
                    if str(copies_in) in text or str(mount) in text:
                        found.append(f"a mount seen by process {proc}")
            except OSError:
                pass
        found += [f"network interface {n}" for n in interfaces(pid)]
        return found + [f"process {p} still sleeping" for p in sleepers()]

    def test_nothing_is_left_behind(rehearsable, tmp_path):
        ck = tmp_path / "ck"
        ck.mkdir()
        (ck / "data").write_bytes(os.urandom(2 * MiB))
        copies = tmp_path / "copies"
        copies.mkdir()
        mount = tmp_path / "mnt"  # made by the harness, and removed
        base = ["--nodes", "2", "--ranks-per-node", "2", "--bandwidth", "50MB/s", "--checkpoint",
                str(ck), "--copies-in", str(copies), "--mount", str(mount), "--json"]

        def run(command, *extra, expect):
            p = subprocess.Popen([sys.executable, HARNESS, *base, *extra, "--", *command],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=60)
            assert p.returncode == expect, out + err
            assert leftovers(p.pid, copies, mount) == []
            assert not mount.exists()
            return json.loads(out)

        # Succeeds: every rank saw its node's copy at the common path; the bytes are counted.
        res = run(["sh", "-c", 'cat "$NODES_CHECKPOINT/data" > /dev/null; echo "$NODE_RANK"'],
                  expect=0)
        assert [e["stdout"].strip() for n in res["per_node"] for e in n["ranks"]] == \
            ["0", "0", "1", "1"]
        assert all(2 * MiB <= n["disk_read_bytes"] <= 3 * MiB for n in res["per_node"]), res
        # The ranks' own counts add up to the node's, but for the file system's metadata, which
        # the kernel charges to no process.
        assert all(0 <= n["disk_read_bytes"] - n["ranks"][0]["read_bytes"]
                   - n["ranks"][1]["read_bytes"] <= MiB for n in res["per_node"]), res
        # Fails, leaving a process behind in its node: killed.
        res = run(["sh", "-c", "sleep 97.125 & exit 3"], expect=1)
        assert [e["exit"] for n in res["per_node"] for e in n["ranks"]] == [3] * 4
        assert sum(res["leftover_processes"]) == 4
        # Times out: every process stopped (with a network of its own: taken down too).
        res = run(["sleep", "97.125"], "--timeout", "1", "--link", "1Gbit/s", expect=124)
        assert res["timed_out"] and all(
            e["exit"] == -signal.SIGTERM for n in res["per_node"] for e in n["ranks"])
        # Stopped by SIGTERM while its ranks run.
        p = subprocess.Popen([sys.executable, HARNESS, *base, "--", "sleep", "97.125"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not sleepers():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGTERM, out + err
        assert leftovers(p.pid, copies, mount) == [] and not mount.exists()

    def test_refusals_exit_77_with_one_line(rehearsable, tmp_path):
        ck = tmp_path / "ck"
        ck.mkdir()
        (ck / "data").write_bytes(b"x")

        def as_nobody():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        r = subprocess.run([sys.executable, HARNESS, "--nodes", "1", "--checkpoint", str(ck),
                            "--", "true"], capture_output=True, text=True, timeout=60,
                           preexec_fn=as_nobody)
        assert r.returncode == 77 and re.fullmatch(r"nodes\.py: cannot rehearse here: not root.*\n",
                                                   r.stderr), r.stderr
        if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
            r = harness("--nodes", "1", "--checkpoint", str(ck), "--copies-in", "/dev/shm", "--",
                        "true")
            assert r.returncode == 77 and "without a block device" in r.stderr, r.stderr

    def harness_module():
        import importlib.util

        spec = importlib.util.spec_from_file_location("nodes_harness", HARNESS)
        nodes = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nodes)
        return nodes

    # Values outside an option's range: argparse's usage error (exit 2) naming the option and
    # what it takes, before anything is set up (no root needed, nothing copied). Before these
    # were refused, --timeout -1 stopped the command at once (exit 124), --timeout nan never,
    # --cpus-per-node nan or inf failed after the cgroups were made, and a --bandwidth under
    # 1 byte/s per node left the nodes unthrottled.
    @pytest.mark.parametrize("args, option, says", [
        (["--timeout", "-1"], "--timeout", "0 (no timeout) or seconds above 0 up to 604800"),
        (["--timeout=-0.5"], "--timeout", "0 (no timeout) or seconds above 0 up to 604800"),
        (["--timeout", "nan"], "--timeout", "got 'nan'"),
        (["--timeout", "inf"], "--timeout", "got 'inf'"),
        (["--timeout=-inf"], "--timeout", "got '-inf'"),
        (["--timeout", "604801"], "--timeout", "up to 604800"),
        (["--timeout", "soon"], "--timeout", "got 'soon'"),
        (["--cpus-per-node", "nan"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--cpus-per-node", "inf"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--cpus-per-node", "0"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--cpus-per-node=-1"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--cpus-per-node", "0.001"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--cpus-per-node", "1025"], "--cpus-per-node", "from 0.01 to 1024"),
        (["--nodes", "0"], "--nodes", "from 1 to 256"),
        (["--nodes=-2"], "--nodes", "from 1 to 256"),
        (["--nodes", "1.5"], "--nodes", "from 1 to 256"),
        (["--nodes", "257"], "--nodes", "from 1 to 256"),
        (["--ranks-per-node", "0"], "--ranks-per-node", "from 1 to 256"),
        (["--ranks-per-node", "nan"], "--ranks-per-node", "from 1 to 256"),
        (["--bandwidth", "nan"], "--bandwidth", "bytes per second"),
        (["--bandwidth", "inf"], "--bandwidth", "bytes per second"),
        (["--bandwidth=-5MB/s"], "--bandwidth", "bytes per second"),
        (["--bandwidth", "0.5"], "--bandwidth", "under 1 byte/s"),
        (["--bandwidth", "2000000000T"], "--bandwidth", "over 1 EB/s"),
        (["--nodes", "4", "--bandwidth", "3"], "--bandwidth", "at least 1 byte/s per node"),
        (["--link", "fast"], "--link", "bits per second"),
        (["--link", "100kbit"], "--link", "512kbit/s"),
        (["--link", "10Gbit/s", "--launcher", "mpirun"], "--link", "needs --launcher direct"),
    ])
    def test_options_out_of_range_are_usage_errors_before_any_set_up(tmp_path, args, option,
                                                                      says):
        ck = tmp_path / "ck"
        ck.mkdir()
        (ck / "data").write_bytes(b"x")
        copies = tmp_path / "copies"
        copies.mkdir()
        r = harness("--nodes", "1", "--checkpoint", str(ck), "--copies-in", str(copies),
                    "--json", *args, "--", "true", timeout=60)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"nodes.py: error: argument {option}: "), r.stderr
        assert says in last, r.stderr
        assert "usage: nodes.py" in r.stderr and r.stdout == ""
        assert list(copies.iterdir()) == []

    def test_options_in_range_parse():
        nodes = harness_module()
        assert nodes.timeout_arg("0") == 0  # no timeout, as --help says
        assert nodes.timeout_arg("0.25") == 0.25 and nodes.timeout_arg("604800") == 604800
        assert nodes.cpus_arg("0.01") == 0.01 and nodes.cpus_arg("1024") == 1024
        assert nodes.count_arg(256)("1") == 1 and nodes.count_arg(256)("256") == 256
        assert nodes.bandwidth_arg("0") is None and nodes.bandwidth_arg("1000000T") == 10 ** 18
        r = harness("--help", timeout=30)
        assert r.returncode == 0 and "or 0 for no timeout" in " ".join(r.stdout.split())

    def test_bandwidths_parse_with_units():
        nodes = harness_module()
        assert nodes.parse_bandwidth("100MB/s") == 100_000_000
        assert nodes.parse_bandwidth("50MiB/s") == 50 * MiB
        assert nodes.parse_bandwidth("1.5G") == 1_500_000_000
        assert nodes.parse_bandwidth("none") is None
        with pytest.raises(ValueError):
            nodes.parse_bandwidth("fast")
        # Links in bits, as networks are sold, or in bytes.
        assert nodes.parse_link("10Gbit/s") == 1_250_000_000
        assert nodes.parse_link("800mbit") == 100_000_000
        assert nodes.parse_link("25gbps") == 3_125_000_000
        assert nodes.parse_link("1.25GB/s") == 1_250_000_000
        assert nodes.parse_link("none") is None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        sys.exit(rank_main(sys.argv[2]))
    # The checks that need no root run everywhere; where the harness refuses, the rest skip and
    # the suite says so with 77 once those passed.
    reason = unsupported_reason()
    code = pytest.main([os.path.abspath(__file__), "-q", "-rs", "-p", "no:cacheprovider"])
    if reason and code == 0:
        print(f"skipped: {reason}")
        sys.exit(77)
    sys.exit(code)
