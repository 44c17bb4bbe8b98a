"""zeroflat.hf.from_pretrained against Transformers' own from_pretrained over many model families
(tiny random models written by save_pretrained, bf16, one process): every parameter and buffer
(non-persistent ones too: rotary and sinusoid tables), which weights are tied, and the logits of
one batch, bit for bit. Each family brings its own names, renaming rules, tied heads, buffers
and fused tensors; scripts/architecture_check.py runs the same comparison over more families
and through the ZeRO-3 and FSDP2 paths too."""

import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import zeroflat.hf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from architecture_check import FAMILIES, compare, tiny_config  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

# Every family of the script: their own names, renaming rules (gpt_neox's embed_out), Conv1D
# weights stored [in, out] (gpt2), tables built in __init__ (gptj), fused query-key-value (bloom,
# falcon), tied heads, stacked experts (mixtral, qwen3_moe), state-space layers (mamba, jamba).
# The parameters Transformers keeps in fp32 (DeepSeek-V3's router) compare as the values in
# the model's dtype (docs/python.md: DeepSpeed's engines cast them).


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_loads_as_transformers_loads_it(family, tmp_path):
    torch.manual_seed(0)
    config = tiny_config(AutoConfig, family)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, tmp_path, None, torch.bfloat16,
                                       device="cpu")
    assert compare(ref, ours, config.vocab_size, fp32_cast=True) == [], family


def test_transformers_4_loads_as_zeroflat_loads():
    """The same comparison under Transformers 4 (4.57.6, installed beside the venv's 5 by
    scripts/setup.sh), every family of the script: its from_pretrained builds with weight init
    off and ties the weights after, which zeroflat's build must do too (Bamba's init failed on
    meta parameters; the heads were left untied)."""
    target = pathlib.Path(sys.prefix) / "transformers-releases" / "4.57.6"
    if not (target / "transformers" / "__init__.py").is_file():
        pytest.fail(f"Transformers 4.57.6 is not installed at {target} (scripts/setup.sh "
                    "installs it)")
    script = pathlib.Path(__file__).parents[2] / "scripts" / "architecture_check.py"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(target)] + sys.path[1:]))
    r = subprocess.run([sys.executable, str(script), "--paths", "zero"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert "4.57.6" in subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env, capture_output=True, text=True, timeout=120).stdout
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{len(FAMILIES)} of {len(FAMILIES)} the same" in r.stdout, r.stdout[-3000:]
    # A config that ties the embeddings over a checkpoint holding another lm_head: Transformers
    # 4 ties them all the same (the embedding's values), where 5 leaves them untied (test_hf.py).
    r = subprocess.run([sys.executable, "-c", _TIED_UNDER_4, str(script.parent)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "SAME []" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


_TIED_UNDER_4 = """
import json, os, sys, tempfile, torch
sys.path.insert(0, sys.argv[1])
from architecture_check import compare
from transformers import AutoModelForCausalLM, LlamaConfig
import zeroflat.hf
d = tempfile.mkdtemp()
torch.manual_seed(3)
AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=300, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).to(
    torch.bfloat16).save_pretrained(d)
c = json.load(open(os.path.join(d, "config.json")))
c["tie_word_embeddings"] = True
json.dump(c, open(os.path.join(d, "config.json"), "w"))
ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, d, None, torch.bfloat16, device="cpu")
assert ref.lm_head.weight is ref.model.embed_tokens.weight
same = compare(ref, ours, 300)
# Tied and saved under both names over one storage (torch.save of the state dict): loaded tied,
# and no tensor of the file is said to be left over.
import logging
said = []
logging.getLogger("zeroflat").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, r: said.append(r.getMessage())})())
torch.save(ref.state_dict(), os.path.join(d, "pytorch_model.bin"))
os.remove(os.path.join(d, "model.safetensors"))
ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, d, None, torch.bfloat16, device="cpu")
assert ours.lm_head.weight is ours.model.embed_tokens.weight
assert not [m for m in said if "not the model's" in m], said
print("SAME", same)
"""
