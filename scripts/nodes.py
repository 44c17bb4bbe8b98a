#!/usr/bin/env python3
"""Rehearses K nodes x R ranks per node on one machine, for real, with the kernel as the witness
(docs/performance.md, "Many nodes on one machine"). Python 3 standard library only; run as root.

    scripts/nodes.py --nodes 4 [--ranks-per-node 1] [--bandwidth 100MB/s] [--cold | --warm]
        --checkpoint DIR [--copies-in DIR] [--mount PATH] [--cpus-per-node X] [--link 10Gbit/s]
        [--launcher direct|mpirun] [--timeout 600] [--json] -- COMMAND [ARGS...]

Each node gets its own copy of the checkpoint, bind-mounted at one common path (--mount;
"{checkpoint}" in COMMAND is replaced by it) in a mount namespace of its own: separate copies are
separate inodes, so a node never reads another node's cached pages, while the ranks of one node
share its page cache. Each node also gets a private /dev/shm (--shared-shm keeps the machine's),
so ranks of different nodes cannot meet through shared memory, as on separate machines. The nodes
share one storage bandwidth: each node's processes run in a block-I/O cgroup that may read the
disk under the copies at --bandwidth / K (and, with --cpus-per-node, a CPU cgroup with that many
cores). --cold writes back and drops every copy from the page cache before the run; --warm reads
every copy once. With --link each node also gets a network namespace of its own, joined to the
others by a bridge over a veth pair whose two ends are shaped (a token bucket each way) to the
link's rate: the network between nodes is a bandwidth, as between machines, where without it the
nodes share the machine's loopback and the network costs only CPU. The kernel counts each
node's bytes sent and received over its link, and each node's bytes read from that disk
(blkio.throttle.io_service_bytes; io.stat on cgroup v2) and each rank's (its rusage, the
read_bytes of /proc/<pid>/io). Those counts include anything else a rank reads from that disk
that is not cached (its Python packages, say): import them once before, as the tests and
benchmarks/nodes_bench.py do. cgroup v1 is what this was measured on; on cgroup v2 it uses
io.max, io.stat and cpu.max under a cgroup of its own, where the io controller can be enabled.

Every rank gets MASTER_ADDR=127.0.0.1, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK (and GROUP_RANK), NNODES, ZEROFLAT_LOCAL_RANKS=R, NODES_CHECKPOINT
(the common path), NODES_CGROUP (its node's block-I/O cgroup directory), NODES_DEVICE
(MAJOR:MINOR of the disk) and NODES_STORAGE_BYTES_PER_S (--bandwidth, 0 unthrottled); with
--cpus-per-node also OMP_NUM_THREADS and ZEROFLAT_NUM_THREADS (that many cores over R ranks) and
NODES_CPU_CGROUP (its cpu.stat counts the quota periods the node waited in); with --link,
MASTER_ADDR is node 0's address, NODES_ADDR the node's own, GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME eth0, NODES_LINK_BYTES_PER_S the link's rate. --launcher mpirun starts the
K*R ranks with one mpirun (TCP on the loopback between ranks: the nodes have private /dev/shm),
each entering its node first.

Cgroups, namespaces (and their mounts) and copies are removed on every exit path: the command
finishing or failing, the timeout (its processes get SIGTERM, then SIGKILL), Ctrl-C, SIGTERM,
SIGHUP. Processes a rank leaves behind in its node's cgroup are killed. --clean-stale removes what
a harness killed with SIGKILL left behind.

Exit codes: 0 every rank exited 0; 1 a rank failed; 2 bad arguments; 3 the harness could not set
up (the copies do not fit, a copy failed); 77 this machine lacks a kernel feature it needs (not
root, no block-I/O cgroup controller, unshare or mount refused, the copies on a filesystem without
a block device), with a one-line reason; 124 the timeout; 130, 143, 129 interrupted by SIGINT,
SIGTERM, SIGHUP.

Past 700 lines on purpose: one standard-library file that a user copies to the machine and
runs as root, without the package."""

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SETUP = 3
EXIT_UNSUPPORTED = 77
EXIT_TIMEOUT = 124

PREFIX = "zeroflat-nodes-"
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
HERE = os.path.abspath(__file__)

# The ranges the options accept (argparse refuses anything else, exit 2, before any set-up).
MAX_NODES = 256  # --nodes: each node is a copy of the checkpoint and a namespace
MAX_RANKS_PER_NODE = 256
MIN_CPUS, MAX_CPUS = 0.01, 1024.0  # --cpus-per-node: the CFS quota's 1 ms per 100 ms period
MAX_BANDWIDTH = 10 ** 18  # bytes/s (1 EB/s): the kernel's throttles take 64-bit values
MAX_TIMEOUT = 7 * 86400  # --timeout: a week
MIN_LINK = 1 << 16  # --link: 64 KiB/s, below which a token bucket holds no full-sized packet
LINK_SUBNET = "10.250"  # the nodes' addresses, 10.250.0.1 up: only inside their namespaces


class Unsupported(Exception):
    """This machine lacks a kernel feature the rehearsal needs (exit 77)."""


class SetupError(Exception):
    """The rehearsal could not be set up (exit 3)."""


class Interrupted(BaseException):
    """A signal asked the harness to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --- small helpers ------------------------------------------------------------------------------

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bandwidth(text):
    """'100MB/s', '400M', '1.5GiB/s', '52428800' -> bytes per second; 'none' or '0' -> None
    (unthrottled). SI prefixes are powers of 1000, IEC ones (Ki, Mi, Gi) of 1024."""
    t = str(text).strip().replace(" ", "")
    if t.lower() in ("none", "unlimited", "0", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(ki|mi|gi|ti|k|m|g|t)?(B|bytes?)?(/s)?", t, re.IGNORECASE)
    if not m or m.group(3) == "b":
        raise ValueError(f"bad bandwidth {text!r}: bytes per second, e.g. 100MB/s, 400M, "
                         "1GiB/s, none (a lowercase b would be bits)")
    t = t.lower()
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(ki|mi|gi|ti|k|m|g|t)?(b|bytes?)?(/s)?", t)
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if value < 1:
        raise ValueError(f"bandwidth {text!r} is under 1 byte/s")
    if value > MAX_BANDWIDTH:
        raise ValueError(f"bandwidth {text!r} is over 1 EB/s ({MAX_BANDWIDTH} bytes/s)")
    return int(value)


def _finite(text):
    """text as a float, or None for anything that is not a finite number (nan and inf too)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def timeout_arg(text):
    """--timeout: 0 (no timeout) or a finite number of seconds above 0, up to a week."""
    value = _finite(text)
    if value is None or not (value == 0 or 0 < value <= MAX_TIMEOUT):
        raise argparse.ArgumentTypeError(
            f"expected 0 (no timeout) or seconds above 0 up to {MAX_TIMEOUT} (a week), "
            f"got {text!r}")
    return value


def cpus_arg(text):
    """--cpus-per-node: a finite number of cores from MIN_CPUS to MAX_CPUS."""
    value = _finite(text)
    if value is None or not MIN_CPUS <= value <= MAX_CPUS:
        raise argparse.ArgumentTypeError(
            f"expected cores from {MIN_CPUS} to {MAX_CPUS:g}, got {text!r}")
    return value


def count_arg(most):
    """An argparse type: a whole number from 1 to most."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {most}, "
                                             f"got {text!r}")
        return value
    return parse


def bandwidth_arg(text):
    """--bandwidth through parse_bandwidth, its ValueError as argparse's."""
    try:
        return parse_bandwidth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_link(text):
    """--link: a node's network bandwidth each way. Bits as networks are sold ('10Gbit/s',
    '25gbit', '800mbit') or bytes as parse_bandwidth reads them ('1.25GB/s'); 'none' -> None
    (no network namespaces: the nodes share the machine's loopback)."""
    t = str(text).strip().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(k|m|g|t)?(?:bits?(?:/s|ps)?|bps)", t, re.IGNORECASE)
    if m:
        value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()] / 8
    else:
        try:
            value = parse_bandwidth(text)
        except ValueError:
            raise ValueError(f"bad link {text!r}: bits per second (10Gbit/s, 800mbit, 25gbps) "
                             "or bytes per second (1.25GB/s), or none") from None
        if value is None:
            return None
    if not MIN_LINK <= value <= MAX_BANDWIDTH:
        raise ValueError(f"link {text!r} must be {MIN_LINK} bytes/s (512kbit/s) to 1 EB/s")
    return int(value)


def link_arg(text):
    try:
        return parse_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human(n):
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


_reserved_ports = []  # lock files held for this process's life, one per port handed out


def free_port():
    """A TCP port for a process group's store, free now and still free when the store listens.

    A port the kernel picks (bind to 0) lies in its ephemeral range, which every outgoing
    connection and every gloo pair of every other process on the machine also draws from: in
    the gap before the store listens, one of them can take it (EADDRINUSE). So the port is taken
    from outside that range, where the kernel never assigns one on its own, and an exclusive
    lock on a file named after it keeps every other caller of this function on the machine (a
    concurrent test, another harness) off it for the rest of this process."""
    import fcntl
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    ports = range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)
    if len(ports) < 256:
        ports = range(1024, 65536)
    folder = os.path.join(tempfile.gettempdir(), "zeroflat-ports")
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        try:
            os.chmod(folder, 0o1777)  # every user's tests share it, as they share the ports
        except OSError:
            pass
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(ports)
        try:  # a lock file another user made is readable, and flock needs no more
            fd = os.open(os.path.join(folder, str(port)), os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            continue
        _reserved_ports.append(fd)
        return port
    raise OSError("no free TCP port found outside the ephemeral range after 200 tries")


def files_under(root):
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            yield os.path.join(dirpath, name)


def tree_bytes(root):
    return sum(os.path.getsize(p) for p in files_under(root))


def drop_from_cache(root):
    """Cold: every file's dirty pages written back, then dropped from the page cache."""
    for path in files_under(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(root):
    """Warm: every file read once, so that its pages are in the cache."""
    buf = bytearray(8 << 20)
    for path in files_under(root):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _checked(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def sys_mount(source, target, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    _checked(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags),
                          enc(data)), f"mount {target}")


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class blocked_signals:
    """Cleanup must not be cut short by a second Ctrl-C: the signals wait until it is done.
    A process started meanwhile must unblock them (unblocked_in_child): masks are inherited."""
    SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


def unblocked_in_child():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked_signals.SIGNALS)


# --- the disk ----------------------------------------------------------------------------------

def block_device(path):
    """MAJOR:MINOR of the whole disk under path (a partition's throttle goes on its disk), and
    that disk's read-ahead in KiB."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysfs = f"/sys/dev/block/{dev}"
    if not os.path.exists(sysfs):
        raise Unsupported(f"{path} is on a filesystem without a block device ({dev}: tmpfs, "
                          "overlay, btrfs?); give --copies-in a directory on a disk")
    real = os.path.realpath(sysfs)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
        with open(os.path.join(real, "dev")) as f:
            dev = f.read().strip()
    read_ahead = None
    try:
        with open(os.path.join(real, "queue", "read_ahead_kb")) as f:
            read_ahead = int(f.read())
    except OSError:
        pass
    return dev, read_ahead


# --- cgroups -----------------------------------------------------------------------------------

def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _procs(directory):
    try:
        with open(os.path.join(directory, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


class CgroupV1:
    """cgroup v1: blkio (throttle per cgroup, not hierarchical: each node gets its share) and,
    when asked, cpu (CFS quota)."""
    version = 1
    BLKIO = "/sys/fs/cgroup/blkio"
    CPU = "/sys/fs/cgroup/cpu"

    @classmethod
    def available(cls):
        return os.path.exists(os.path.join(cls.BLKIO, "blkio.throttle.read_bps_device"))

    def __init__(self, want_cpu):
        if want_cpu and not os.path.exists(os.path.join(self.CPU, "cpu.cfs_quota_us")):
            raise Unsupported("--cpus-per-node needs the cpu cgroup controller "
                              f"({self.CPU}/cpu.cfs_quota_us is missing)")
        self.want_cpu = want_cpu

    def make(self, name, device, read_bps, cpus):
        dirs = [os.path.join(self.BLKIO, name)]
        if self.want_cpu:
            dirs.append(os.path.join(self.CPU, name))
        made = []
        try:
            for d in dirs:
                os.mkdir(d)
                made.append(d)
            if read_bps:
                _write(os.path.join(dirs[0], "blkio.throttle.read_bps_device"),
                       f"{device} {read_bps}")
            if cpus:
                _write(os.path.join(dirs[1], "cpu.cfs_period_us"), "100000")
                _write(os.path.join(dirs[1], "cpu.cfs_quota_us"),
                       str(max(1000, int(cpus * 100000))))
        except BaseException:  # whatever failed (a value the kernel refuses, a signal)
            for d in reversed(made):
                os.rmdir(d)
            raise
        return dirs

    @staticmethod
    def read_bytes(dirs, device):
        with open(os.path.join(dirs[0], "blkio.throttle.io_service_bytes")) as f:
            for line in f:
                fields = line.split()
                if len(fields) == 3 and fields[0] == device and fields[1] == "Read":
                    return int(fields[2])
        return 0

    @staticmethod
    def remove(dirs):
        for d in reversed(dirs):
            if os.path.isdir(d):
                os.rmdir(d)

    @classmethod
    def stale(cls):
        return [os.path.join(root, n) for root in (cls.BLKIO, cls.CPU) if os.path.isdir(root)
                for n in os.listdir(root) if n.startswith(PREFIX)]


class CgroupV2:
    """cgroup v2: one parent under the root with io (and cpu) enabled for its children; io.max
    per node, io.stat for the bytes."""
    version = 2
    ROOT = "/sys/fs/cgroup"

    @classmethod
    def is_v2(cls):
        try:
            with open("/proc/self/mounts") as f:
                return any(line.split()[1:3] == [cls.ROOT, "cgroup2"] for line in f)
        except OSError:
            return False

    def __init__(self, want_cpu, name):
        with open(os.path.join(self.ROOT, "cgroup.controllers")) as f:
            controllers = f.read().split()
        need = ["io"] + (["cpu"] if want_cpu else [])
        missing = [c for c in need if c not in controllers]
        if missing:
            raise Unsupported(f"cgroup v2 at {self.ROOT} lacks the {' and '.join(missing)} "
                              "controller(s)")
        self.parent = os.path.join(self.ROOT, name)
        self.want_cpu = want_cpu
        enable = " ".join("+" + c for c in need)
        try:
            _write(os.path.join(self.ROOT, "cgroup.subtree_control"), enable)
            os.mkdir(self.parent)
        except OSError as e:
            raise Unsupported(f"cgroup v2: cannot enable {enable} under {self.ROOT}: "
                              f"{e.strerror}") from None
        try:
            _write(os.path.join(self.parent, "cgroup.subtree_control"), enable)
        except OSError as e:
            os.rmdir(self.parent)
            raise Unsupported(f"cgroup v2: cannot enable {enable} for child cgroups: "
                              f"{e.strerror}") from None

    def make(self, name, device, read_bps, cpus):
        d = os.path.join(self.parent, name)
        os.mkdir(d)
        try:
            if read_bps:
                _write(os.path.join(d, "io.max"), f"{device} rbps={read_bps}")
            if cpus:
                _write(os.path.join(d, "cpu.max"), f"{max(1000, int(cpus * 100000))} 100000")
        except BaseException:
            os.rmdir(d)
            raise
        return [d]

    @staticmethod
    def read_bytes(dirs, device):
        with open(os.path.join(dirs[0], "io.stat")) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == device:
                    for kv in fields[1:]:
                        k, _, v = kv.partition("=")
                        if k == "rbytes":
                            return int(v)
        return 0

    @staticmethod
    def remove(dirs):
        for d in dirs:
            if os.path.isdir(d):
                os.rmdir(d)

    def close(self):
        if os.path.isdir(self.parent):
            os.rmdir(self.parent)

    @classmethod
    def stale(cls):
        return [os.path.join(cls.ROOT, n) for n in os.listdir(cls.ROOT) if n.startswith(PREFIX)]


def node_read_bytes(cgroup_dir=None, device=None):
    """From inside a rank: the bytes its node has read from the disk so far, as the kernel
    counts them (NODES_CGROUP and NODES_DEVICE by default); None outside a rehearsal."""
    cgroup_dir = cgroup_dir or os.environ.get("NODES_CGROUP")
    device = device or os.environ.get("NODES_DEVICE")
    if not cgroup_dir or not device:
        return None
    v1 = os.path.exists(os.path.join(cgroup_dir, "blkio.throttle.io_service_bytes"))
    return (CgroupV1 if v1 else CgroupV2).read_bytes([cgroup_dir], device)


def node_cpu_periods(cgroup_dir=None):
    """From inside a rank: (quota periods its node has run in, periods in which it used up its
    CPU quota and waited) so far, from the node's cpu cgroup (NODES_CPU_CGROUP by default); None
    without a quota. Their ratio over a phase is how much of it the CPU quota bounded."""
    cgroup_dir = cgroup_dir or os.environ.get("NODES_CPU_CGROUP")
    if not cgroup_dir:
        return None
    stat = {}
    try:
        with open(os.path.join(cgroup_dir, "cpu.stat")) as f:
            for line in f:
                k, _, v = line.partition(" ")
                stat[k] = int(v)
    except (OSError, ValueError):
        return None
    if "nr_periods" not in stat:
        return None
    return stat["nr_periods"], stat.get("nr_throttled", 0)


def node_link_bytes():
    """From inside a rank of a run with a link: (bytes its node has sent, bytes it has received)
    over its link so far (eth0's counters in the node's network namespace); None without one."""
    if not os.environ.get("NODES_LINK_BYTES_PER_S"):
        return None
    # /proc/net/dev is the reader's network namespace (/sys/class/net is that of whoever
    # mounted /sys: the machine's, in a node's mount namespace).
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, counts = line.partition(":")
                if name.strip() == "eth0":
                    fields = counts.split()
                    return int(fields[8]), int(fields[0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_backend(want_cpu, name):
    if CgroupV1.available():
        return CgroupV1(want_cpu)
    if CgroupV2.is_v2():
        return CgroupV2(want_cpu, name)
    raise Unsupported("no block-I/O cgroup controller: neither cgroup v1 blkio at "
                      f"{CgroupV1.BLKIO} nor cgroup v2 at {CgroupV2.ROOT}")


def kill_cgroup(dirs, sig, grace=0.0):
    """Sends sig to every process in the cgroup (each by its pid), then waits up to grace seconds
    for it to empty. Returns the pids that were there."""
    seen = set()
    deadline = time.monotonic() + grace
    while True:
        pids = [p for d in dirs for p in _procs(d)]
        if not pids:
            return seen
        for pid in pids:
            if pid not in seen or sig == signal.SIGKILL:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            seen.add(pid)
        if time.monotonic() >= deadline:
            return seen
        time.sleep(0.05)


def remove_cgroup(backend, dirs):
    """Kills what is left in the cgroup and removes it, waiting for its processes to be gone
    (rmdir fails while a process, even a dying one, is in it)."""
    leftovers = kill_cgroup(dirs, signal.SIGKILL, grace=10.0)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            backend.remove(dirs)
            return leftovers
        except OSError:
            if time.monotonic() >= deadline:
                raise
            kill_cgroup(dirs, signal.SIGKILL)
            time.sleep(0.05)


# --- the node's mount namespace: held by an agent, entered by its ranks --------------------------

def node_agent(mount, copy, private_shm, private_net=False):
    """Runs in a child of the harness: a new mount namespace with the node's copy bind-mounted at
    the common path (and a private /dev/shm; with private_net a network namespace of its own,
    which the harness wires), held until the harness closes our stdin."""
    try:
        _checked(libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        if private_net:
            _checked(libc().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        sys_mount(None, "/", None, MS_REC | MS_PRIVATE)
        sys_mount(copy, mount, None, MS_BIND)
        if private_shm:
            sys_mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    except OSError as e:
        print(f"error: {e.strerror if e.strerror else e}", flush=True)
        return EXIT_UNSUPPORTED
    print("ready", flush=True)
    sys.stdin.read()  # until the harness closes it (or dies)
    return 0


def enter_rank(spec_path, command):
    """The wrapper every rank runs first (also under mpirun): joins its node's cgroups and mount
    namespace, then runs the command as a child, forwards signals to it, and writes its exit
    status and the kernel's count of its reads (rusage) next to the spec."""
    with open(spec_path) as f:
        spec = json.load(f)
    rank = None
    for var in ("NODES_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            rank = int(os.environ[var])
            break
    if rank is None or rank >= spec["world_size"]:
        print(f"nodes.py: cannot tell this rank's number (rank {rank})", file=sys.stderr)
        return EXIT_USAGE
    per_node = spec["ranks_per_node"]
    node, local = divmod(rank, per_node)
    for d in spec["cgroups"][node]:
        _write(os.path.join(d, "cgroup.procs"), str(os.getpid()))
    if spec.get("net"):  # the node's network first: the mount namespace below hides /proc's view
        fd = os.open(f"/proc/{spec['agents'][node]}/ns/net", os.O_RDONLY)
        try:
            _checked(libc().setns(fd, CLONE_NEWNET), "setns(network namespace)")
        finally:
            os.close(fd)
    fd = os.open(f"/proc/{spec['agents'][node]}/ns/mnt", os.O_RDONLY)
    try:
        _checked(libc().setns(fd, CLONE_NEWNS), "setns(mount namespace)")
    finally:
        os.close(fd)
    os.chdir(spec["cwd"])  # setns moved us to the namespace's root
    env = dict(os.environ)
    env.pop("NODES_RANK", None)
    env.update(spec["env"])
    env.update(RANK=str(rank), LOCAL_RANK=str(local), NODE_RANK=str(node),
               GROUP_RANK=str(node), NODES_CGROUP=spec["cgroups"][node][0])
    if spec.get("cpu_quota"):
        env["NODES_CPU_CGROUP"] = spec["cgroups"][node][-1]
    if spec.get("net"):
        env["NODES_ADDR"] = node_address(node)
    base = os.path.join(spec["dir"], f"rank{rank}")
    with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
        t0 = time.monotonic()
        try:
            child = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        except OSError as e:
            err.write(f"nodes.py: cannot run {command[0]}: {e.strerror}\n".encode())
            status, usage = 127 << 8, None
        else:
            def forward(signum, _frame):
                try:
                    os.kill(child.pid, signum)
                except ProcessLookupError:
                    pass
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, forward)
            _, status, usage = os.wait4(child.pid, 0)
        seconds = time.monotonic() - t0
    code = os.waitstatus_to_exitcode(status)
    result = {"rank": rank, "node": node, "local_rank": local, "exit": code,
              "seconds": seconds,
              "read_bytes": usage.ru_inblock * 512 if usage else 0,
              "max_rss_bytes": usage.ru_maxrss * 1024 if usage else 0,
              "cpu_seconds": usage.ru_utime + usage.ru_stime if usage else 0.0}
    with open(base + ".json.tmp", "w") as f:
        json.dump(result, f)
    os.rename(base + ".json.tmp", base + ".json")
    return code if code >= 0 else 128 - code


# --- the network between nodes -----------------------------------------------------------------

LINK_PREFIX = "zfn"  # interface names: at most 15 characters, zfn<pid>br, zfn<pid>n<node>


def node_address(node):
    """Node i's address on the simulated network (inside its namespace only)."""
    return f"{LINK_SUBNET}.{node // 250}.{node % 250 + 1}"


def _net(args, pid=None):
    """Runs an ip or tc command, in the network namespace of process pid when given."""
    cmd = (["nsenter", f"--net=/proc/{pid}/ns/net"] if pid else []) + args
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise Unsupported(f"{cmd[0]} is not installed (it comes with iproute2 or util-linux)")
    if r.returncode != 0:
        raise OSError(f"{' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")


class Links:
    """The network of a run with --link: a bridge in the harness's own network namespace and,
    for each node, a veth pair from it into the node's namespace (eth0 there, address
    node_address(i)). Both ends are shaped by a token bucket to bps: eth0's egress is what the
    node sends, the bridge side's egress what it receives, so each node has a full-duplex link
    of bps each way, as a NIC has. The harness's namespace gets no address and no route, so
    nothing of the machine's own network changes. The bridge side's counters are the kernel's
    count of what each node sent and received."""

    def __init__(self, tag, bps):
        self.tag = tag
        self.bps = bps
        self.bridge = None
        self.ends = []

    def open(self, agent_pids):
        bridge = f"{self.tag}br"
        _net(["ip", "link", "add", bridge, "type", "bridge"])
        self.bridge = bridge
        _net(["ip", "link", "set", bridge, "up"])
        for i, pid in enumerate(agent_pids):
            end, peer = f"{self.tag}n{i}", f"{self.tag}p{i}"
            _net(["ip", "link", "add", end, "type", "veth", "peer", "name", peer])
            self.ends.append(end)
            _net(["ip", "link", "set", peer, "netns", str(pid)])
            _net(["ip", "link", "set", peer, "name", "eth0"], pid)
            _net(["ip", "addr", "add", f"{node_address(i)}/16", "dev", "eth0"], pid)
            _net(["ip", "link", "set", "eth0", "up"], pid)
            _net(["ip", "link", "set", "lo", "up"], pid)
            _net(["ip", "link", "set", end, "master", bridge, "up"])
            self._shape("eth0", pid)
            self._shape(end)

    def _shape(self, dev, pid=None):
        # The bucket holds 10 ms at the rate, and never less than a few 64 KiB segments (veth
        # passes segmentation-offloaded packets that large; a smaller bucket drops them).
        burst = max(self.bps // 100, 256 << 10)
        _net(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.bps * 8}bit",
              "burst", str(burst), "latency", "200ms"], pid)

    def counts(self):
        """Per node, (bytes it sent, bytes it received) over its link; None where unreadable."""
        out = []
        for end in self.ends:
            try:
                stats = f"/sys/class/net/{end}/statistics/"
                with open(stats + "rx_bytes") as f:
                    sent = int(f.read())
                with open(stats + "tx_bytes") as f:
                    received = int(f.read())
                out.append((sent, received))
            except (OSError, ValueError):
                out.append(None)
        return out

    def close(self):
        """Removes the bridge and the bridge side of every pair (which takes the other end with
        it); returns the errors, if any."""
        errors = []
        for name in self.ends + ([self.bridge] if self.bridge else []):
            if os.path.exists(f"/sys/class/net/{name}"):
                try:
                    _net(["ip", "link", "del", name])
                except (OSError, Unsupported) as e:
                    errors.append(str(e))
        self.ends, self.bridge = [], None
        return errors


# --- the rehearsal -----------------------------------------------------------------------------

class Rehearsal:
    """K copies of a checkpoint and the means to run commands as K nodes over them.

        with Rehearsal(checkpoint, nodes=4) as r:
            result = r.run(["python3", "rank.py"], ranks_per_node=1, bandwidth=100e6, cold=True)

    A run may use fewer nodes than there are copies. Everything is removed by close() (and by
    __exit__), whatever happened."""

    def __init__(self, checkpoint, nodes, *, copies_in=None, mount=None, cpus=False,
                 private_shm=True, log=None):
        if os.geteuid() != 0:
            raise Unsupported("not root (mount namespaces, bind mounts and cgroups need root)")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1 to {MAX_NODES}, not {nodes}")
        if not os.path.isdir(checkpoint):
            raise ValueError(f"the checkpoint {checkpoint!r} is not a directory")
        self.checkpoint = os.path.abspath(checkpoint)
        self.nodes = nodes
        self.copies_in = os.path.abspath(copies_in or tempfile.gettempdir())
        self.mount_arg = mount
        self.want_cpu = cpus
        self.private_shm = private_shm
        self.log = log or (lambda msg: None)
        self.name = f"{PREFIX}{os.getpid()}-"
        self.workdir = None
        self.mount = None
        self.made_mount = False
        self.copies = []
        self.cg = None
        self.runs = 0
        self.checkpoint_bytes = 0

    # set-up and clean-up

    def __enter__(self):
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self):
        if not os.path.isdir(self.copies_in):
            raise ValueError(f"--copies-in {self.copies_in!r} is not a directory")
        self.device, self.read_ahead_kb = block_device(self.copies_in)
        self.cg = cgroup_backend(self.want_cpu, self.name + "parent")
        self.workdir = tempfile.mkdtemp(prefix=self.name, dir=self.copies_in)
        if self.mount_arg:
            self.mount = os.path.abspath(self.mount_arg)
            if not os.path.isdir(self.mount):
                os.mkdir(self.mount)  # only the last component: a typo is not a tree
                self.made_mount = True
        else:
            self.mount = os.path.join(self.workdir, "checkpoint")
            os.mkdir(self.mount)
        self._probe()
        self.checkpoint_bytes = tree_bytes(self.checkpoint)
        need = self.checkpoint_bytes * self.nodes
        free = shutil.disk_usage(self.copies_in).free
        if need + (1 << 30) > free:
            raise SetupError(f"{self.nodes} copies need {human(need)} (+ 1 GiB spare) in "
                             f"{self.copies_in}, which has {human(free)} free")
        for i in range(self.nodes):
            dest = os.path.join(self.workdir, f"node{i}")
            self.log(f"copying the checkpoint for node {i} ({human(self.checkpoint_bytes)})")
            try:
                shutil.copytree(self.checkpoint, dest)
            except OSError as e:
                raise SetupError(f"copying the checkpoint to {dest}: {e}") from None
            self.copies.append(dest)

    def _probe(self):
        """unshare and mount work here, and a cgroup can be made and written, before any copy."""
        try:
            dirs = self.cg.make(self.name + "probe", self.device, 1 << 40,
                                1.0 if self.want_cpu else None)
        except OSError as e:
            raise Unsupported(f"cannot make a cgroup: {e}") from None
        try:
            self.cg.remove(dirs)
        except OSError:
            pass
        agent = self._start_agent(self.workdir)
        self._stop_agents([agent])

    def close(self):
        with blocked_signals():
            if self.workdir and os.path.isdir(self.workdir):
                shutil.rmtree(self.workdir, ignore_errors=True)
            if self.made_mount and self.mount and os.path.isdir(self.mount):
                try:
                    os.rmdir(self.mount)
                except OSError:
                    pass
            if isinstance(self.cg, CgroupV2):
                try:
                    self.cg.close()
                except OSError:
                    pass
            self.copies = []
            self.workdir = None

    # agents: one per node, holding its mount namespace

    def _start_agent(self, copy, net=False):
        agent = subprocess.Popen(
            [sys.executable, HERE, "--_node", self.mount, copy,
             "1" if self.private_shm else "0", "1" if net else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        line = agent.stdout.readline().decode().strip()
        if line != "ready":
            self._stop_agents([agent])
            reason = line[len("error: "):] if line.startswith("error: ") else (
                line or f"the node agent exited with {agent.returncode}")
            raise Unsupported(f"cannot give a node its own mount namespace: {reason}")
        return agent

    @staticmethod
    def _stop_agents(agents):
        for a in agents:
            try:
                a.stdin.close()
            except OSError:
                pass
        for a in agents:
            try:
                a.wait(timeout=5)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
            a.stdout.close()

    # one run

    def run(self, command, *, nodes=None, ranks_per_node=1, bandwidth=None, cold=True,
            cpus_per_node=None, timeout=None, launcher="direct", mpirun_args=(), env=None,
            link=None):
        """Runs command as nodes x ranks_per_node ranks and returns the result (a dict; see
        the module's --json). bandwidth: total bytes/s of the disk shared by the nodes (None:
        unthrottled). link: each node's network bytes/s each way (None: no network namespaces,
        the nodes share the machine's loopback)."""
        nodes = self.nodes if nodes is None else nodes
        if not 1 <= nodes <= self.nodes:
            raise ValueError(f"nodes must be 1 to {self.nodes} (the copies made)")
        if not 1 <= ranks_per_node <= MAX_RANKS_PER_NODE:
            raise ValueError(f"ranks_per_node must be 1 to {MAX_RANKS_PER_NODE}, "
                             f"not {ranks_per_node}")
        if bandwidth is not None and bandwidth != 0 and not nodes <= bandwidth <= MAX_BANDWIDTH:
            raise ValueError(f"bandwidth must be {nodes} (1 byte/s per node) to {MAX_BANDWIDTH} "
                             f"bytes/s, or None (unthrottled), not {bandwidth}")
        if cpus_per_node is not None and not MIN_CPUS <= cpus_per_node <= MAX_CPUS:
            raise ValueError(f"cpus_per_node must be {MIN_CPUS} to {MAX_CPUS:g}, "
                             f"not {cpus_per_node}")
        if timeout is not None and not (timeout == 0 or 0 < timeout <= MAX_TIMEOUT):
            raise ValueError(f"timeout must be 0 or None (no timeout) or seconds above 0 up to "
                             f"{MAX_TIMEOUT}, not {timeout}")
        if cpus_per_node is not None and not self.want_cpu:
            raise ValueError("cpus_per_node needs Rehearsal(..., cpus=True)")
        if launcher not in ("direct", "mpirun"):
            raise ValueError(f"unknown launcher {launcher!r}")
        if link is not None and not MIN_LINK <= link <= MAX_BANDWIDTH:
            raise ValueError(f"link must be {MIN_LINK} to {MAX_BANDWIDTH} bytes/s, or None, "
                             f"not {link}")
        if link is not None and launcher != "direct":
            # mpirun's ranks reach it over the harness's loopback, which a node's own network
            # namespace does not have.
            raise ValueError("a link between nodes needs the direct launcher, not mpirun")
        world = nodes * ranks_per_node
        per_node_bps = bandwidth // nodes if bandwidth else None
        command = [str(a).replace("{checkpoint}", self.mount) for a in command]
        self.runs += 1
        rundir = os.path.join(self.workdir, f"run{self.runs}")
        os.mkdir(rundir)
        cgroups, agents, procs = [], [], []
        result = {
            "nodes": nodes, "ranks_per_node": ranks_per_node, "world_size": world,
            "bandwidth_bytes_per_s": bandwidth, "per_node_bytes_per_s": per_node_bps,
            "cpus_per_node": cpus_per_node, "cache": "cold" if cold else "warm",
            "launcher": launcher, "command": command, "checkpoint": self.checkpoint,
            "checkpoint_bytes": self.checkpoint_bytes, "mount": self.mount,
            "copies": self.workdir, "device": self.device, "read_ahead_kb": self.read_ahead_kb,
            "cgroup_version": self.cg.version, "private_shm": self.private_shm,
            "link_bytes_per_s": link, "cgroups": [], "timed_out": False}
        timed_out = False
        links = Links(f"{LINK_PREFIX}{os.getpid()}", link) if link else None
        try:
            for i in range(nodes):
                name = f"{self.name}r{self.runs}-node{i}"
                cgroups.append(self.cg.make(name, self.device, per_node_bps, cpus_per_node))
                result["cgroups"].extend(cgroups[-1])
            for i in range(nodes):
                agents.append(self._start_agent(self.copies[i], net=links is not None))
            if links:
                try:
                    links.open([a.pid for a in agents])
                except OSError as e:
                    raise Unsupported(f"cannot wire the nodes' network: {e}") from None
            for copy in self.copies[:nodes]:
                (drop_from_cache if cold else read_through)(copy)
            port = free_port()
            common = {"MASTER_ADDR": node_address(0) if links else "127.0.0.1",
                      "MASTER_PORT": str(port),
                      "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ranks_per_node),
                      "NNODES": str(nodes), "ZEROFLAT_LOCAL_RANKS": str(ranks_per_node),
                      "NODES_CHECKPOINT": self.mount, "NODES_DEVICE": self.device,
                      "NODES_STORAGE_BYTES_PER_S": str(bandwidth or 0)}
            if links:
                # Gloo would pick the address of the host's name, which no other node reaches.
                common.update(GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0",
                              NODES_LINK_BYTES_PER_S=str(link))
            if cpus_per_node:
                threads = str(max(1, int(cpus_per_node / ranks_per_node + 0.5)))
                common.update(OMP_NUM_THREADS=threads, ZEROFLAT_NUM_THREADS=threads)
            common.update(env or {})
            spec = {"world_size": world, "ranks_per_node": ranks_per_node, "cwd": os.getcwd(),
                    "cgroups": cgroups, "agents": [a.pid for a in agents], "dir": rundir,
                    "env": common, "net": links is not None,
                    "cpu_quota": bool(cpus_per_node)}
            spec_path = os.path.join(rundir, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            enter = [sys.executable, HERE, "--_enter", spec_path, "--"]
            t0 = time.monotonic()
            with blocked_signals():  # a signal waits until every process started is tracked
                if launcher == "direct":
                    for r in range(world):
                        procs.append(subprocess.Popen(
                            enter + command, env=dict(os.environ, NODES_RANK=str(r)),
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=unblocked_in_child))
                else:
                    procs.append(self._mpirun(world, mpirun_args, enter + command, rundir))
            deadline = t0 + timeout if timeout else None
            while any(p.poll() is None for p in procs):
                if deadline and time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
            result["seconds"] = time.monotonic() - t0
        finally:
            with blocked_signals():
                self._end_run(procs, agents, cgroups, result, timed_out, links)
        result["timed_out"] = timed_out
        self._collect(result, rundir, procs, launcher)
        shutil.rmtree(rundir, ignore_errors=True)
        return result

    @staticmethod
    def _mpirun(world, mpirun_args, command, rundir):
        """One mpirun for every rank; TCP on the loopback between ranks (a node's /dev/shm is its
        own, so Open MPI's shared-memory transport cannot join ranks of different nodes)."""
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        with open(os.path.join(rundir, "mpirun.out"), "wb") as out:
            return subprocess.Popen(
                ["mpirun", "-np", str(world), "--oversubscribe", "--bind-to", "none",
                 "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
                 "--mca", "oob_tcp_if_include", "lo", *mpirun_args] + command,
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=unblocked_in_child)

    def _end_run(self, procs, agents, cgroups, result, timed_out, links=None):
        """Every process of the run stopped (SIGTERM first when they were still running, then
        SIGKILL), the kernel's counts read, the cgroups and namespaces removed."""
        running = [p for p in procs if p.poll() is None]
        if running:
            for p in running:  # the launcher (mpirun) first: it stops its ranks
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for dirs in cgroups:
                kill_cgroup(dirs, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        leftovers = []
        for dirs in cgroups:
            leftovers.append(len(kill_cgroup(dirs, signal.SIGKILL, grace=10.0)))
        for p in procs:
            p.wait()
        read = []
        for dirs in cgroups:
            try:
                read.append(self.cg.read_bytes(dirs, self.device))
            except OSError:
                read.append(None)
        errors = []
        for dirs in cgroups:
            try:
                remove_cgroup(self.cg, dirs)
            except OSError as e:
                errors.append(f"{dirs[0]}: {e}")
        result["link_bytes"] = links.counts() if links else None
        if links:
            errors.extend(links.close())
        self._stop_agents(agents)
        result["disk_read_bytes"] = read
        result["leftover_processes"] = leftovers
        result["cleanup_errors"] = errors

    def _collect(self, result, rundir, procs, launcher):
        ranks = []
        for r in range(result["world_size"]):
            base = os.path.join(rundir, f"rank{r}")
            try:
                with open(base + ".json") as f:
                    entry = json.load(f)
            except (OSError, ValueError):
                node, local = divmod(r, result["ranks_per_node"])
                code = procs[r].returncode if launcher == "direct" else None
                entry = {"rank": r, "node": node, "local_rank": local,
                         "exit": code, "seconds": None, "read_bytes": None}
            for stream in ("out", "err"):
                try:
                    with open(f"{base}.{stream}", "rb") as f:
                        entry["std" + stream] = f.read().decode(errors="replace")
                except OSError:
                    entry["std" + stream] = ""
            ranks.append(entry)
        if launcher == "mpirun":
            try:
                with open(os.path.join(rundir, "mpirun.out"), "rb") as f:
                    result["launcher_output"] = f.read().decode(errors="replace")
            except OSError:
                result["launcher_output"] = ""
            result["launcher_exit"] = procs[0].returncode if procs else None
        size = self.checkpoint_bytes
        k = result["nodes"]
        net = result.get("link_bytes") or [None] * k
        result["per_node"] = [
            {"node": i, "disk_read_bytes": result["disk_read_bytes"][i],
             "link_sent_bytes": net[i][0] if net[i] else None,
             "link_received_bytes": net[i][1] if net[i] else None,
             "x_share": (result["disk_read_bytes"][i] / (size / k)
                         if size and result["disk_read_bytes"][i] is not None else None),
             "ranks": [e for e in ranks if e["node"] == i]}
            for i in range(k)]
        counted = [b for b in result["disk_read_bytes"] if b is not None]
        result["disk_read_bytes_total"] = sum(counted)
        result["x_checkpoint"] = sum(counted) / size if size else None
        failed = [e["rank"] for e in ranks if e["exit"] != 0]
        result["failed_ranks"] = failed
        if result["timed_out"]:
            result["exit"] = EXIT_TIMEOUT
        elif failed or (launcher == "mpirun" and result.get("launcher_exit")):
            result["exit"] = EXIT_FAILED
        else:
            result["exit"] = 0


def clean_stale(copies_in=None, log=print):
    """Removes what a harness that died without cleaning up (SIGKILL) left: cgroups, and copy
    directories in copies_in (default the temp dir), named after a process that no longer runs.
    Mounts died with their namespaces."""
    removed = []
    backend = CgroupV1 if CgroupV1.available() else (CgroupV2 if CgroupV2.is_v2() else None)
    dirs = backend.stale() if backend else []
    for d in sorted(dirs, key=len, reverse=True):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", os.path.basename(d))
        if m and not pid_alive(int(m.group(1))):
            kill_cgroup([d], signal.SIGKILL, grace=5.0)
            try:
                os.rmdir(d)
                removed.append(d)
            except OSError as e:
                log(f"cannot remove {d}: {e}")
    try:
        interfaces = os.listdir("/sys/class/net")
    except OSError:
        interfaces = []
    for n in interfaces:
        m = re.fullmatch(re.escape(LINK_PREFIX) + r"(\d+)(br|n\d+)", n)
        if m and not pid_alive(int(m.group(1))):
            try:
                _net(["ip", "link", "del", n])
                removed.append(f"network interface {n}")
            except (OSError, Unsupported) as e:
                log(f"cannot remove the network interface {n}: {e}")
    tmp = copies_in or tempfile.gettempdir()
    for n in os.listdir(tmp):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", n)
        if m and not pid_alive(int(m.group(1))) and os.path.isdir(os.path.join(tmp, n)):
            shutil.rmtree(os.path.join(tmp, n), ignore_errors=True)
            removed.append(os.path.join(tmp, n))
    return removed


def check_throttle(copies_in, size=200 << 20, bps=50 << 20):
    """Reads size bytes cold through a bps cap and returns (seconds, bytes the kernel counted):
    200 MiB at 50 MiB/s should take about 4 s where the throttle works."""
    device, _ = block_device(copies_in)
    cg = cgroup_backend(False, f"{PREFIX}{os.getpid()}-parent")
    work = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=copies_in)
    dirs = None
    try:
        path = os.path.join(work, "data")
        block = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(block)
        drop_from_cache(work)
        dirs = cg.make(f"{PREFIX}{os.getpid()}-throttle", device, bps, None)
        reader = ("import sys\nf = open(sys.argv[1], 'rb', buffering=0)\n"
                  "while f.read(1 << 20):\n    pass\n")
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", reader, path], preexec_fn=lambda: _write(
            os.path.join(dirs[0], "cgroup.procs"), str(os.getpid())))
        p.wait()
        seconds = time.monotonic() - t0
        counted = cg.read_bytes(dirs, device)
        return seconds, counted, device
    finally:
        with blocked_signals():
            if dirs:
                remove_cgroup(cg, dirs)
            if isinstance(cg, CgroupV2):
                cg.close()
            shutil.rmtree(work, ignore_errors=True)


def net_holder():
    """Runs in a child of check_link: a network namespace of its own, held until stdin closes."""
    try:
        _checked(libc().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    except OSError as e:
        print(f"error: {e.strerror if e.strerror else e}", flush=True)
        return EXIT_UNSUPPORTED
    print("ready", flush=True)
    sys.stdin.read()
    return 0


_SINK = """import socket, sys, time
s = socket.socket()
s.bind(("0.0.0.0", 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20)
n, t0 = 0, None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    t0 = t0 or time.monotonic()
    n += k
print(n, time.monotonic() - t0, flush=True)
"""

_SOURCE = """import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    s.sendall(block)
s.close()
"""


def check_link(bps=50 * 10 ** 6, size=100 << 20):
    """Sends size bytes over TCP from one simulated node to another through links of bps each
    way and returns (seconds, bytes received, the kernel's count at the sender's link): 100 MiB
    at 400 Mbit/s should take about 2.1 s where the shaping works."""
    holders, links = [], Links(f"{LINK_PREFIX}{os.getpid()}", bps)
    sink = None
    try:
        for _ in range(2):
            h = subprocess.Popen([sys.executable, HERE, "--_net"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, start_new_session=True)
            holders.append(h)
            line = h.stdout.readline().decode().strip()
            if line != "ready":
                raise Unsupported("cannot give a node its own network namespace: "
                                  + (line[len("error: "):] if line.startswith("error: ")
                                     else line or f"exit {h.wait()}"))
        try:
            links.open([h.pid for h in holders])
        except OSError as e:
            raise Unsupported(f"cannot wire the nodes' network: {e}") from None
        into = ["nsenter", f"--net=/proc/{holders[0].pid}/ns/net", sys.executable, "-c"]
        try:
            sink = subprocess.Popen(into + [_SINK], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            raise Unsupported("nsenter is not installed (it comes with util-linux)") from None
        port = sink.stdout.readline().strip()
        if not port.isdigit():
            raise SetupError("the receiving end of the link check did not start")
        subprocess.run(["nsenter", f"--net=/proc/{holders[1].pid}/ns/net", sys.executable, "-c",
                        _SOURCE, node_address(0), port, str(size >> 20)], check=True,
                       timeout=600)
        received, seconds = sink.stdout.readline().split()
        sink.wait(timeout=60)
        counted = links.counts()[1]
        return float(seconds), int(received), counted[0] if counted else None
    finally:
        with blocked_signals():
            if sink and sink.poll() is None:
                sink.kill()
                sink.wait()
            links.close()
            for h in holders:
                h.stdin.close()
                h.wait()
                h.stdout.close()


# --- the command line --------------------------------------------------------------------------

def print_summary(res, quiet=False, out=sys.stdout):
    k, r = res["nodes"], res["ranks_per_node"]
    bw = res["bandwidth_bytes_per_s"]
    size = res["checkpoint_bytes"]
    print(f"{k} node(s) x {r} rank(s), storage "
          + (f"{human(bw)}/s shared ({human(res['per_node_bytes_per_s'])}/s per node)"
             if bw else "unthrottled")
          + (f", {res['cpus_per_node']} cores per node" if res["cpus_per_node"] else "")
          + (f", links of {human(res['link_bytes_per_s'])}/s each way"
             if res.get("link_bytes_per_s") else "")
          + f", {res['cache']}; checkpoint {human(size)}; disk {res['device']} (read-ahead "
          f"{res['read_ahead_kb']} KiB), cgroup v{res['cgroup_version']}; "
          f"{res.get('seconds', 0):.2f} s", file=out)
    print(f"{'node':>4} {'disk read':>11} {'x 1/K':>6}  ranks: exit, seconds, read_bytes",
          file=out)
    for n in res["per_node"]:
        ranks = "; ".join(
            f"{e['rank']}: {e['exit']}, "
            + (f"{e['seconds']:.2f} s" if e.get("seconds") is not None else "-")
            + f", {human(e.get('read_bytes'))}" for e in n["ranks"])
        xs = f"{n['x_share']:.2f}" if n["x_share"] is not None else "-"
        net = (f"  network sent {human(n['link_sent_bytes'])}, received "
               f"{human(n['link_received_bytes'])}" if n.get("link_sent_bytes") is not None
               else "")
        print(f"{n['node']:>4} {human(n['disk_read_bytes']):>11} {xs:>6}  {ranks}{net}",
              file=out)
    print(f"all nodes: {human(res['disk_read_bytes_total'])} read from the disk, "
          + (f"{res['x_checkpoint']:.2f} x the checkpoint" if res["x_checkpoint"] is not None
             else "") + (f"; leftover processes killed: {sum(res['leftover_processes'])}"
                         if any(res["leftover_processes"]) else ""), file=out)
    if res["timed_out"]:
        print("TIMED OUT: every process of the run was stopped", file=out)
    for e in [e for n in res["per_node"] for e in n["ranks"]]:
        if quiet and e["exit"] == 0:
            continue
        for stream in ("stdout", "stderr"):
            text = e.get(stream, "").rstrip()
            if text:
                lines = text.splitlines()
                tail = lines[-20:] if e["exit"] != 0 or quiet else lines[-5:]
                print(f"--- rank {e['rank']} {stream} (last {len(tail)} of {len(lines)} lines)",
                      file=out)
                print("\n".join(tail), file=out)
    if res.get("launcher_exit"):
        print(f"--- mpirun exited {res['launcher_exit']}:\n"
              + res.get("launcher_output", "")[-2000:], file=out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_node"]:
        return node_agent(argv[1], argv[2], argv[3] == "1", argv[4:5] == ["1"])
    if argv[:1] == ["--_net"]:
        return net_holder()
    if argv[:1] == ["--_enter"]:
        return enter_rank(argv[1], argv[3:])
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    else:
        command = []
    ap = argparse.ArgumentParser(
        prog="nodes.py", description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 ok, 1 a rank failed, 2 bad arguments, 3 set-up failed, "
               "77 kernel features missing, 124 timeout, 128+N a signal.")
    ap.add_argument("--nodes", type=count_arg(MAX_NODES),
                    help=f"K: simulated nodes (1 to {MAX_NODES})")
    ap.add_argument("--ranks-per-node", type=count_arg(MAX_RANKS_PER_NODE), default=1,
                    help=f"R (1 to {MAX_RANKS_PER_NODE}; default 1)")
    ap.add_argument("--bandwidth", type=bandwidth_arg, default="none",
                    help="storage read bandwidth shared by all nodes, e.g. 100MB/s, 1GiB/s, "
                         "at least 1 byte/s per node and at most 1EB/s "
                         "(default none: unthrottled; 0 is none too); each node gets 1/K of it")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--cold", dest="cold", action="store_true", default=True,
                       help="every copy written back and dropped from the page cache (default)")
    cache.add_argument("--warm", dest="cold", action="store_false",
                       help="every copy read once before the run")
    ap.add_argument("--checkpoint", help="the directory each node gets a copy of")
    ap.add_argument("--copies-in", help="where the copies go (a disk; default the temp dir)")
    ap.add_argument("--mount", help="the common path the ranks see their node's copy at "
                                    "(default: a fresh empty directory next to the copies)")
    ap.add_argument("--cpus-per-node", type=cpus_arg,
                    help=f"a CPU quota per node, in cores (cpu cgroup), {MIN_CPUS} to "
                         f"{MAX_CPUS:g}")
    ap.add_argument("--shared-shm", action="store_true",
                    help="keep the machine's /dev/shm in every node (default: one per node)")
    ap.add_argument("--link", type=link_arg, default="none",
                    help="each node's network, each way, e.g. 10Gbit/s, 800mbit, 1.25GB/s: every "
                         "node gets a network namespace of its own, wired to the others through "
                         "a bridge over links shaped to that rate (default none: the nodes "
                         "share the machine's loopback, and the network costs only CPU)")
    ap.add_argument("--launcher", choices=("direct", "mpirun"), default="direct")
    ap.add_argument("--mpirun-arg", action="append", default=[],
                    help="one more argument for mpirun (repeatable)")
    ap.add_argument("--timeout", type=timeout_arg, default=600,
                    help="seconds before the run is stopped: above 0 up to "
                         f"{MAX_TIMEOUT} (a week), or 0 for no timeout (default 600)")
    ap.add_argument("--json", action="store_true", help="the result as JSON on stdout")
    ap.add_argument("--quiet", action="store_true", help="no output of ranks that succeeded")
    ap.add_argument("--check-throttle", action="store_true",
                    help="only measure: 200 MiB read cold through a 50 MiB/s cap (about 4 s)")
    ap.add_argument("--check-link", action="store_true",
                    help="only measure: 100 MiB over TCP between two nodes through a 400 Mbit/s "
                         "link (about 2.1 s)")
    ap.add_argument("--clean-stale", action="store_true",
                    help="only remove what a harness killed with SIGKILL left behind")
    args = ap.parse_args(argv)

    def refuse(reason):
        print(f"nodes.py: cannot rehearse here: {reason}", file=sys.stderr)
        return EXIT_UNSUPPORTED

    def interrupted(signum, _frame):
        raise Interrupted(signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupted)
    try:
        if args.clean_stale:
            if os.geteuid() != 0:
                return refuse("not root")
            for path in clean_stale(args.copies_in):
                print(f"removed {path}")
            return 0
        if args.check_throttle:
            if os.geteuid() != 0:
                return refuse("not root")
            seconds, counted, device = check_throttle(args.copies_in or tempfile.gettempdir())
            print(f"disk {device}: 200 MiB read cold through a 50 MiB/s cap in {seconds:.2f} s "
                  f"(expected about 4 s); the kernel counted {counted / (1 << 20):.1f} MiB")
            return 0 if 3.0 <= seconds <= 6.0 else EXIT_FAILED
        if args.check_link:
            if os.geteuid() != 0:
                return refuse("not root")
            seconds, received, counted = check_link()
            print(f"100 MiB over TCP between two nodes through 400 Mbit/s links in {seconds:.2f} s "
                  f"(expected about 2.1 s); received {received / (1 << 20):.1f} MiB, the kernel "
                  f"counted {(counted or 0) / (1 << 20):.1f} MiB on the sender's link")
            return 0 if 1.6 <= seconds <= 3.0 and received == 100 << 20 else EXIT_FAILED
        if args.nodes is None:
            ap.error("--nodes K is required")
        if not args.checkpoint:
            ap.error("--checkpoint DIR is required")
        if not command:
            ap.error("the command to run goes after --")
        if args.link is not None and args.launcher != "direct":
            ap.error("argument --link: needs --launcher direct (mpirun reaches its ranks over "
                     "the machine's loopback, which a node's own network does not have)")
        bandwidth = args.bandwidth
        if bandwidth is not None and bandwidth < args.nodes:
            # Each node's throttle is its share: under 1 byte/s it would be none at all.
            ap.error(f"argument --bandwidth: {bandwidth} bytes/s over {args.nodes} nodes leaves "
                     "a node under 1 byte/s; expected at least 1 byte/s per node")
        log = (lambda msg: None) if args.json else (
            lambda msg: print(f"[nodes] {msg}", file=sys.stderr))
        with Rehearsal(args.checkpoint, args.nodes, copies_in=args.copies_in,
                       mount=args.mount, cpus=args.cpus_per_node is not None,
                       private_shm=not args.shared_shm, log=log) as rehearsal:
            res = rehearsal.run(command, ranks_per_node=args.ranks_per_node,
                                bandwidth=bandwidth, cold=args.cold,
                                cpus_per_node=args.cpus_per_node,
                                timeout=args.timeout or None, launcher=args.launcher,
                                mpirun_args=args.mpirun_arg, link=args.link)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print_summary(res, quiet=args.quiet)
        return res["exit"]
    except Unsupported as e:
        return refuse(e)
    except (SetupError, ValueError) as e:
        print(f"nodes.py: {e}", file=sys.stderr)
        return EXIT_SETUP if isinstance(e, SetupError) else EXIT_USAGE
    except KeyboardInterrupt:
        print("nodes.py: interrupted; cleaned up", file=sys.stderr)
        return 128 + signal.SIGINT
    except Interrupted as e:
        print(f"nodes.py: {e}; cleaned up", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
