"""One load loop for every placement: every option of zeroflat.load_param_groups (and of
zeroflat.hf.from_pretrained, which calls it) means the same and is checked the same way under
ZeRO-1/2 and ZeRO-3; refusals come before DeepSpeed makes anything process-wide; ranks that
differ are told what differs (CPU, gloo, 2 ranks)."""

import logging
import os
import re
import shutil
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
from transformers import AutoModelForCausalLM  # noqa: E402

import zeroflat  # noqa: E402
import zeroflat.hf  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, free_port, init_deepspeed_rank, start_ranks  # noqa: E402
from test_hf import tiny_moe, write  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


def ds3(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, **zero}, "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True}


@pytest.fixture(scope="module")
def checkpoint():
    root = tempfile.mkdtemp(prefix="zeroflat-options-")
    yield write(tiny_moe(), os.path.join(root, "moe"), torch.bfloat16)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("zero3", [None, ds3()])
def test_bad_values_are_refused_under_every_stage(checkpoint, zero3):
    """copies= and deepspeed= are checked the same way whatever the placement (they were
    accepted silently under ZeRO-3)."""
    init_deepspeed_rank(0, 1, free_port())
    for bad, match in ((dict(copies="bogus"), "copies 'bogus'"),
                       (dict(copies=None), "copies=None"),
                       (dict(deepspeed="0.1.0"), "0.1.0"),
                       (dict(read_plan="fastest"), "read_plan 'fastest'")):
        with pytest.raises(ValueError, match=match):
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, checkpoint, zero3=zero3, **bad)
    torch.distributed.destroy_process_group()


def test_param_groups_and_zero3_of_the_wrong_kind_are_named(checkpoint):
    """A string where the groups go (not its characters as names), and a ZeRO-3 config whose
    zero_optimization is not a section: errors that say so."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(TypeError, match="param_groups is a str"):
        zeroflat.load_param_groups(model, checkpoint, param_groups="trainer", deepspeed=None)
    with pytest.raises(ValueError, match="zero_optimization is 3"):
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, checkpoint,
                                    zero3={"zero_optimization": 3})


def test_an_empty_group_has_no_flat_group_and_a_frozen_one_is_refused(checkpoint):
    """ZeRO-1/2 returns a FlatGroup per group in order, but for an empty group: DeepSpeed's
    engine removes a client optimizer's empty groups (every release from 0.14), so the list
    lines up with its ZeRO optimizer's groups. A group holding only frozen parameters, which
    DeepSpeed keeps and its optimizer fails on, is refused naming its index, nothing read."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(config)
    named = list(model.named_parameters())
    named[0][1].requires_grad_(False)
    names = [n for n, _ in named]
    with pytest.raises(ValueError, match=r"param_groups\[2\] holds 1 parameter\(s\), none"):
        zeroflat.load_param_groups(model, checkpoint, deepspeed=None, device="cpu",
                                   param_groups=[[], names[1:3], [names[0]], names[3:]])
    assert all(p.device.type == "meta" for p in model.parameters())
    groups = zeroflat.load_param_groups(model, checkpoint, param_groups=[[], names[1:3], names[3:]],
                                        deepspeed=None, device="cpu")
    params = list(model.parameters())
    assert len(groups) == 2
    assert [id(p) for p in groups[0].params] == [id(p) for p in params[1:3]]
    assert [id(p) for p in groups[1].params] == [id(p) for p in params[3:]]
    assert params[0].device.type == "cpu" and not params[0].requires_grad


def copies_worker(rank, world, port, root, ours):
    """Each rank loads its own copy of the checkpoint; rank 1's differs by one byte."""
    init_deepspeed_rank(rank, world, port)
    path = os.path.join(root, f"copy{rank}")
    for zero3 in (None, ds3()):
        with pytest.raises(zeroflat.Error, match="hold different bytes"):
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=zero3, copies="full")
        # The same copies pass with the check off, and the ranks then hold what each read.
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=zero3, copies="off")
    torch.distributed.destroy_process_group()
    end_rank()


def test_copies_that_differ_are_refused_on_every_rank_under_every_stage(checkpoint, tmp_path):
    import json
    import struct

    for rank in (0, 1):
        shutil.copytree(checkpoint, tmp_path / f"copy{rank}")
    # One byte in the middle of the largest tensor differs in rank 1's copy (its headers are the
    # same).
    tensors = []
    for f in sorted((tmp_path / "copy1").glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                lo, hi = t["data_offsets"]
                tensors.append((hi - lo, f, 8 + n + (lo + hi) // 2))
    _, f, at = max(tensors)
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x40]))
    start_ranks(copies_worker, 2, str(tmp_path), None, preload=("transformers",))


def hpz_worker(rank, world, port, path):
    """A refused hpZ load leaves nothing behind: Transformers' own ZeRO-3 load with the same
    config then works in the same process."""
    from transformers.integrations import HfDeepSpeedConfig

    init_deepspeed_rank(rank, world, port)
    config = ds3(zero_hpz_partition_size=2)
    with pytest.raises(NotImplementedError, match="hpZ"):
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=config)
    for refused in (dict(offload_param={"device": "nvme", "nvme_path": "/nonexistent"}),
                    dict(zero_quantized_weights=True)):
        with pytest.raises(NotImplementedError):
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=ds3(**refused))
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - Transformers holds it weakly
    model = AutoModelForCausalLM.from_pretrained(path)
    assert all(hasattr(p, "ds_tensor") for p in model.parameters())
    torch.distributed.destroy_process_group()
    end_rank()


def test_refusals_come_before_deepspeed_makes_anything(checkpoint):
    start_ranks(hpz_worker, 2, checkpoint, preload=("transformers",))


def differ_worker(rank, world, port, paths):
    """Rank 1's checkpoint has a layer fewer; then the ranks pass different param_groups: every
    rank's error names the first thing that differs and what each side has."""
    init_deepspeed_rank(rank, world, port)
    other = 1 - rank
    for zero3 in (None, ds3()):
        with pytest.raises(ValueError) as e:
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, paths[rank], zero3=zero3)
        text = str(e.value)
        assert "differ" in text and f"on rank {other}" in text, text
        # The layer the other rank's model lacks is named (on one side of the difference).
        assert re.search(r"model\.layers\.2\.|\(none\)", text), text
    groups = ([["model.norm.weight"]] if rank == 0 else [["lm_head.weight"]])
    for zero3 in (None, ds3()):
        with pytest.raises(ValueError) as e:
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, paths[0], zero3=zero3,
                                        param_groups=groups)
        text = str(e.value)
        mine, theirs = ("model.norm.weight", "lm_head.weight")[::1 if rank == 0 else -1]
        assert mine in text and theirs in text and f"on rank {other}" in text, text
    torch.distributed.destroy_process_group()
    end_rank()


def test_ranks_that_differ_are_told_what_differs(checkpoint, tmp_path):
    three = write(tiny_moe().__class__(**{**tiny_moe().to_dict(), "num_hidden_layers": 3}),
                  str(tmp_path / "three"), torch.bfloat16)
    start_ranks(differ_worker, 2, [three, checkpoint], preload=("transformers",))
