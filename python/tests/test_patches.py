"""Every change zeroflat makes to DeepSpeed, Transformers and torch is one Patch of one mechanism,
listed in docs/patches.md: the page says what the code's table says, every patch the drop-in
puts in place has its row, nothing is patched at import, and everything is put back."""

import pathlib

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import zeroflat  # noqa: E402
from zeroflat import _patches  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "patches.md"


def test_the_page_is_the_table():
    text = DOC.read_text()
    assert text.endswith(_patches.table_markdown()), "docs/patches.md differs from _patches.TABLE"


def _attributes(owners):
    return {(id(o), name): vars(o).get(name) for o in owners for name in list(vars(o))}


def test_install_patches_only_what_the_table_lists_and_uninstall_puts_it_all_back():
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    import zeroflat.deepspeed as zd

    owners = [stage_1_and_2.DeepSpeedZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3, stage3,
              torch.Tensor, torch.nn.Module]
    before = _attributes(owners)
    assert not zd.is_installed()  # importing changed nothing
    zd.install()
    try:
        applied = zd._applied.entries
        assert applied, "install() put nothing in place"
        for owner, name, _ in applied:
            assert _patches.is_patched(owner, name), (owner, name)
            assert _patches.row_of(owner, name) is not None, \
                f"{_patches._name(owner)}.{name} is patched but docs/patches.md has no row for it"
    finally:
        zd.uninstall()
    assert _attributes(owners) == before


def test_a_failed_patch_set_changes_nothing():
    class Owner:
        def f(self):
            return 1

    before = dict(vars(Owner))
    with pytest.raises(RuntimeError, match="no g to patch"):
        _patches.apply([_patches.Patch(Owner, "f", hook=lambda original, self: 2),
                        _patches.Patch(Owner, "g", hook=lambda original, self: 3)])
    assert dict(vars(Owner)) == before
    with _patches.patched([_patches.Patch(Owner, "f", hook=lambda original, self: original(self)
                                          + 1)]):
        assert Owner().f() == 2
        assert Owner.f.__wrapped__ is before["f"]
    assert Owner().f() == 1 and dict(vars(Owner)) == before


def test_building_a_model_patches_only_while_it_is_built():
    register = torch.nn.Module.register_parameter
    subclass = torch.nn.Module.__dict__.get("__init_subclass__")
    linear_init = torch.nn.Linear.__init__
    with zeroflat.meta_parameters():
        assert torch.nn.Module.register_parameter is not register
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    assert model[0].weight.device.type == "meta"
    assert torch.nn.Module.register_parameter is register
    assert torch.nn.Module.__dict__.get("__init_subclass__") is subclass
    assert torch.nn.Linear.__init__ is linear_init
    for entry in ("torch.nn.Module.register_parameter", "torch.nn.Module.__init_subclass__"):
        assert any(entry in e.target for e in _patches.TABLE), entry
