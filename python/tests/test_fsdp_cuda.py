"""zeroflat.fsdp.load into CUDA DTensors: a model sharded by FSDP2 on a CUDA mesh, materialized
on the GPU, filled from a bf16 safetensors checkpoint into fp32 and bf16 parameters (the
library's CUDA device and its ring of pinned chunks, converted on the way): every local shard on
the GPU equal to the checkpoint's values as torch converts them, each byte read once. Needs a
CUDA device and a zeroflat built with CUDA: it skips elsewhere, and scripts/gpu_check.sh runs it
(as a script too, where pytest is not installed: exit 0 passed, 1 failed, 77 skipped).

Written with no package beyond torch (the GPU machine has no Transformers): the checkpoint is
written here in the safetensors format."""

import json
import os
import socket
import struct
import sys
import tempfile

import torch

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None

ST = {torch.bfloat16: "BF16", torch.float32: "F32"}


def write_safetensors(path, tensors):
    """The safetensors format: an 8-byte little-endian header size, the JSON header, the data."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1001, 64)
        self.fc = torch.nn.Linear(64, 48)
        self.head = torch.nn.Linear(48, 7, bias=False)
        self.fc.to(torch.bfloat16)  # one bf16 part, the rest fp32

    def forward(self, x):
        return self.head(self.fc(self.embed(x).to(torch.bfloat16)).float()).square().mean()


NO_CUDA_BUILD = "this build has no CUDA"  # the library's words where CUDA was not compiled in


def reason_to_skip():
    return None if torch.cuda.is_available() else "no CUDA device"


def check_cuda_dtensors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zeroflat.fsdp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = Net()
        saved = {n: t.detach().to(torch.bfloat16) for n, t in ref.state_dict().items()}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "model.safetensors")
            write_safetensors(path, saved)
            with torch.device("meta"):
                model = Net()
            mesh = init_device_mesh("cuda", (1,))
            fully_shard(model.fc, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cuda")
            try:
                report = zeroflat.fsdp.load(model, path)
            except zeroflat.NoFeasiblePlan as e:
                # What the planner was told: the probes and every candidate's reason.
                detail = getattr(e, "report", None) or {}
                detail = detail.get("loads", [detail])[-1] if "loads" in detail else detail
                print(json.dumps({k: detail.get(k) for k in ("host_probe", "probe", "plan")},
                                 indent=1, default=str), file=sys.stderr)
                raise
        for n, p in model.named_parameters():
            local = p.to_local()
            assert local.is_cuda, n
            want = saved[n].to(local.dtype)
            assert torch.equal(local.cpu(), want), n
        assert report["bytes_read"] == report["share"] == sum(
            t.numel() * t.element_size() for t in saved.values()), report
        # DCP's load through zeroflat.dcp.Reader into the same kind of CUDA shards: each box read
        # on the host, then copied to the GPU.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        import zeroflat.dcp

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "model.safetensors")
            write_safetensors(path, saved)
            with torch.device("meta"):
                other = Net()
            fully_shard(other.fc, mesh=mesh)
            fully_shard(other, mesh=mesh)
            other.to_empty(device="cuda")
            reader = zeroflat.dcp.Reader(path)
            dcp.load(get_model_state_dict(other), storage_reader=reader)
        for n, p in other.named_parameters():
            local = p.to_local()
            assert local.is_cuda, n
            assert torch.equal(local.cpu(), saved[n].to(local.dtype)), n
        assert reader.bytes_read == report["share"], (reader.bytes_read, report)
        # The loaded shards train: one step on the GPU.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(torch.randint(0, 1001, (4, 5), device="cuda"))
        loss.backward()
        opt.step()
        assert torch.isfinite(loss).item()
    finally:
        dist.destroy_process_group()


def test_loads_into_cuda_dtensors():
    why = reason_to_skip()
    if why:
        pytest.skip(why)
    try:
        check_cuda_dtensors()
    except Exception as e:  # noqa: BLE001 - only the build's own refusal is a skip
        if NO_CUDA_BUILD in str(e):
            pytest.skip(str(e))
        raise


if __name__ == "__main__":
    why = reason_to_skip()
    if why is None:
        try:
            check_cuda_dtensors()
        except Exception as e:  # noqa: BLE001
            if NO_CUDA_BUILD not in str(e):
                raise
            why = str(e)
    if why:
        print(f"skipped: {why}")
        sys.exit(77)
    print("passed: zeroflat.fsdp.load into CUDA DTensors")
    sys.exit(0)
