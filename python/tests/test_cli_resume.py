"""`zeroflat load DIR --from deepspeed`: a DeepSpeed checkpoint saved by 2 ranks (ZeRO-2 and
ZeRO-3, DeepSpeed's own save on the CPU) resumed by the command at 3 ranks. Every rank reads about
its exact share, --verify passes, and each buffer it keeps is, byte for byte, its partition of
the values torch.load reads from the saved files (laid out as DeepSpeed lays them out at 3 ranks);
its bytes are the ones `inspect --dp 3` plans. Bad input (a stage the checkpoint was not saved
with, a rank's file missing, a safetensors load of a DeepSpeed folder) is exit 2 naming it."""

import json
import os
import shutil
import subprocess

import pytest
import torch

from test_torch_file import TAG, cli_path, new_partitions, saved, saved_values
from test_torch_file import inspect as inspect_checkpoint

MB = 1_000_000


def zeroflat(*args, expect_rc=0):
    r = subprocess.run([str(cli_path()), *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == expect_rc, (args, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r


def resume(ckpt, *args):
    return json.loads(zeroflat("load", ckpt, "--from", "deepspeed", "--json", "--quiet",
                               *args).stdout)


def checksum(t):
    from zeroflat import _C

    t = t.contiguous()
    return "%016x" % _C.TorchDevice("cpu", 1).checksum(t.data_ptr(), t.numel() * t.element_size())


@pytest.mark.parametrize("stage", [2, 3])
def test_three_ranks_resume_a_two_rank_checkpoint(tmp_path_factory, stage):
    ckpt = saved(tmp_path_factory, None, stage, 2)
    doc = resume(ckpt, "--dp", 3, "--verify")
    for key in ("checkpoint", "from", "tag", "format", "zero_stage", "saved_world", "stage", "dp",
                "dtype", "targets", "read_plan", "kept_bytes", "bytes_read", "share_bytes",
                "plan", "read_gbps", "page_cache", "ceiling", "ranks", "exit", "error"):
        assert key in doc, key
    assert doc["exit"] == 0 and doc["error"] is None
    assert doc["from"] == "deepspeed" and doc["tag"] == TAG and doc["saved_world"] == 2
    assert doc["zero_stage"] == stage and doc["stage"] == stage and doc["dp"] == 3
    assert doc["targets"] == ["fp32", "exp_avg", "exp_avg_sq"]
    assert doc["read_plan"] == ("load-partitions" if stage == 3 else "load-slice")
    assert len(doc["ranks"]) == 3

    described = inspect_checkpoint(ckpt, "--json")
    values, _ = saved_values(ckpt, described)
    plan = inspect_checkpoint(ckpt, "--json", "--dp", 3)["resume"]["ranks"]
    for r, rank in enumerate(doc["ranks"]):
        for key in ("rank", "read_plan", "bytes_read", "share_bytes", "read_over_share", "reads",
                    "seconds", "read_gbps", "predicted_peak_device_bytes",
                    "measured_peak_device_bytes", "kept_bytes", "verified", "loads"):
            assert key in rank, key
        assert rank["rank"] == r and rank["verified"] is True
        assert rank["bytes_read"] <= 1.1 * rank["share_bytes"] + 8 * MB, rank
        # Each rank keeps every buffer: its peak is at least all of them.
        assert rank["measured_peak_device_bytes"] >= rank["kept_bytes"] > 0
        assert rank["predicted_peak_device_bytes"] == rank["measured_peak_device_bytes"]
        # The same bytes `inspect --dp 3` plans for the master and the partitioned states.
        planned = sum(x["bytes"] for x in plan[r]["reads"]
                      if x["target"] in ("fp32", "exp_avg", "exp_avg_sq"))
        assert rank["bytes_read"] == planned
        # fp32 and exp_avg: the new partitions of what torch.load reads from the files.
        want = new_partitions(described, values, 3, r)
        loads = {(x["target"], x["group"]): x for x in rank["loads"]}
        for which, target in enumerate(("fp32", "exp_avg")):
            if stage == 3:  # one buffer: every group's partitions back to back
                assert loads[(target, None)]["checksum"] == checksum(
                    torch.cat([w[which] for w in want]))
            else:
                for g, w in enumerate(want):
                    assert loads[(target, g)]["checksum"] == checksum(w[which]), (target, g)

    # The same resume rehearsed on simulated devices from the headers alone: the same bytes.
    sim = resume(ckpt, "--dp", 3, "--device", "sim:h100-80gb", "--no-data")
    assert sim["exit"] == 0 and sim["no_data"] is True
    assert [x["bytes_read"] for x in sim["ranks"]] == [x["bytes_read"] for x in doc["ranks"]]


def test_bad_stages_and_missing_files_are_exit_2_naming_them(tmp_path_factory, tmp_path):
    zero2 = saved(tmp_path_factory, None, 2, 2)
    zero3 = saved(tmp_path_factory, None, 3, 2)
    r = zeroflat("load", zero2, "--from", "deepspeed", "--dp", 3, "--stage", 3, expect_rc=2)
    assert "--stage 3" in r.stderr and "ZeRO-2" in r.stderr, r.stderr
    r = zeroflat("load", zero3, "--from", "deepspeed", "--dp", 3, "--stage", 2, expect_rc=2)
    assert "--stage 2" in r.stderr and "ZeRO-3" in r.stderr, r.stderr
    # A safetensors load pointed at a DeepSpeed folder says how to resume it.
    r = zeroflat("load", zero2, "--dp", 3, expect_rc=2)
    assert "--from deepspeed" in r.stderr, r.stderr
    for name, src in (("zero2", zero2), ("zero3", zero3)):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        missing = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        (dst / TAG / missing).unlink()
        r = zeroflat("load", dst, "--from", "deepspeed", "--dp", 3, expect_rc=2)
        assert missing in r.stderr, r.stderr


def test_a_folder_without_latest_and_one_whose_latest_is_a_fifo(tmp_path_factory, tmp_path):
    """Without 'latest', --tag names the folder for inspect as for load; a 'latest' that is a
    FIFO is refused naming it (never read, nor taken for a folder of safetensors files)."""
    dst = tmp_path / "nolatest"
    shutil.copytree(saved(tmp_path_factory, None, 2, 2), dst)
    (dst / "latest").unlink()
    shown = json.loads(zeroflat("inspect", dst, "--tag", TAG, "--json").stdout)
    loaded = resume(dst, "--tag", TAG, "--dp", 2)
    assert shown["tag"] == TAG and loaded["exit"] == 0, (shown, loaded)
    os.mkfifo(dst / "latest")
    for args in (("inspect", dst), ("load", dst, "--from", "deepspeed", "--dp", 2)):
        r = zeroflat(*args, expect_rc=2)
        assert "latest" in r.stderr and "not a regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("stage,saved_world", [(1, 2), (2, 2), (3, 2), (2, 1), (3, 1),
                                               ("universal", 2)])
def test_inspect_plans_the_bytes_the_loader_reads(tmp_path_factory, stage, saved_world):
    """inspect --dp W and `load --from deepspeed --dp W` take their plan from the same library
    operation: every rank's bytes in inspect's plan are the bytes the loader counted reading,
    for every format and world the resume tests use."""
    if stage == "universal":
        from test_torch_file import universal_of
        ckpt = universal_of(tmp_path_factory)
    else:
        ckpt = saved(tmp_path_factory, None, stage, saved_world)
    for world in (1, 2, 3, 4):
        plan = inspect_checkpoint(ckpt, "--json", "--dp", world)["resume"]
        doc = resume(ckpt, "--dp", world)
        assert doc["exit"] == 0, doc["error"]
        for r, (rank, planned) in enumerate(zip(doc["ranks"], plan["ranks"])):
            loader = {(x["target"], x["group"]): x["bytes_read"] for x in rank["loads"]}
            mine = {(b["target"], b["group"]): b["read_bytes"] for b in planned["buffers"]
                    if b["target"] != "frozen"}
            assert loader == mine, (stage, saved_world, world, r, loader, mine)
            assert rank["bytes_read"] == sum(mine.values())
            assert rank["share_bytes"] == sum(b["share_bytes"] for b in planned["buffers"]
                                              if b["target"] != "frozen")
