"""Pre-packed oneDNN linears: same results as ``F.linear``, dense weights still exported."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels.cpu import library as native
from kvmesh.model.cpu_linear import PackedLinear, can_pack, pack_linears
from kvmesh.model.loader import load_model

CPU = torch.device("cpu")
# Packing itself needs oneDNN; whether it is on by default (not on AMX CPUs) is tested below, everywhere.
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias, monkeypatch):
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")  # on AMX CPUs packing is off by default, not impossible
    if not can_pack(CPU, dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    gen = torch.Generator().manual_seed(0)
    dense = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(dense)
    for rows in (1, 7, 16, 300):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got, want = packed(x), F.linear(x, dense.weight, dense.bias)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16 and not bias:
            assert torch.equal(got, want)
        elif dtype == torch.bfloat16:  # the bias is added before rounding, not after: one bf16 ulp apart
            assert torch.allclose(got.float(), want.float(), rtol=8e-3, atol=1e-3)
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 96, generator=gen).to(dtype)
    assert packed(x3).shape == (2, 3, 200)
    assert torch.equal(packed.weight, dense.weight.detach())
    state = packed.state_dict()
    assert sorted(state) == (["bias", "weight"] if bias else ["weight"])
    assert torch.equal(state["weight"], dense.weight.detach())


@needs_onednn
def test_loaded_cpu_model_is_packed_and_exports_its_dense_weights(monkeypatch):
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")  # packed even on an AMX machine, where it is off by default
    packed = load_model("tiny-llama")
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "0")
    plain = load_model("tiny-llama")
    assert not can_pack(CPU, torch.float32)
    monkeypatch.delenv("KVMESH_PACKED_LINEAR")
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    assert any(isinstance(m, nn.Linear) for m in plain.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    ours, theirs = packed.model.hf_state_dict(), plain.model.hf_state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert packed.fingerprint == plain.fingerprint  # packing is a layout, not different weights
    assert pack_linears(packed.model) == 0  # nothing left to pack
    assert not can_pack(torch.device("meta"), torch.float32)
    assert not can_pack(CPU, torch.float16)


def test_onednn_packing_is_off_by_default_where_the_cpu_has_amx_and_the_native_panels_are_not(monkeypatch):
    """Measured: oneDNN-packed linears are slower than F.linear where oneDNN has AMX kernels (docs/benchmarks.md);
    float32 weights still go to the native kernel's panels there (AMX has no float32 tiles; a decode step on
    them measured faster than F.linear's sgemm on a 2-core AMX machine)."""
    from kvmesh.model import cpu_linear

    monkeypatch.delenv("KVMESH_PACKED_LINEAR", raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_features", lambda: ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"])
    assert not can_pack(CPU, torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "native_linear_wanted", lambda: True)
    assert can_pack(CPU, torch.float32)  # the native panels
    monkeypatch.setattr(cpu_linear, "native_linear_wanted", lambda: False)
    assert not can_pack(CPU, torch.float32)  # oneDNN's layout: off with AMX
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")
    assert can_pack(CPU, torch.float32)
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "0")
    monkeypatch.setattr(cpu_linear, "native_linear_wanted", lambda: True)
    assert not can_pack(CPU, torch.float32)
    monkeypatch.delenv("KVMESH_PACKED_LINEAR")
    monkeypatch.setattr(cpu_linear, "native_linear_wanted", lambda: False)
    monkeypatch.setattr(cpu_linear, "cpu_features", lambda: ["avx2", "avx512_bf16", "avx512f"])
    assert can_pack(CPU, torch.float32)


def test_a_float32_model_on_a_cpu_with_the_native_kernel_decodes_on_its_panels(monkeypatch):
    """Where the native kernel is built, a float32 CPU model's linears are its panels, AMX or not."""
    if not native.has_linear():
        pytest.skip("the native float32 kernel is not built for this CPU (no AVX2 with FMA)")
    monkeypatch.delenv("KVMESH_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("KVMESH_NATIVE_LINEAR", raising=False)
    model = load_model("tiny-llama").model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and not any(isinstance(m, nn.Linear) for m in model.modules())
    assert all(m.panels is not None for m in packed)



needs_native = pytest.mark.skipif(not native.has_linear(), reason="the native linear needs a CPU with AVX2 and FMA")


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_linear_matches_a_float64_product(threads):
    """Every tile shape (1..6 rows, balanced splits of more, groups of panels), partial last panels and groups,
    odd k, with and without bias; the packed weight unpacks to the dense one exactly."""
    gen = torch.Generator().manual_seed(1)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out_features, in_features in ((1, 1), (16, 19), (37, 96), (200, 576), (3000, 64)):
            weight = torch.randn(out_features, in_features, generator=gen)
            bias = torch.randn(out_features, generator=gen)
            packed = native.pack_linear(weight)
            assert packed.shape == (-(-out_features // 16), in_features, 16)
            assert torch.equal(native.unpack_linear(packed, out_features), weight)
            for rows in (1, 2, 3, 4, 5, 6, 7, 11, 13, 16, 50, 131):
                x = torch.randn(rows, in_features, generator=gen)
                for b in (None, bias):
                    got = native.linear(x, packed, out_features, b)
                    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
                    assert got.shape == (rows, out_features)
                    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * in_features ** 0.5), \
                        (out_features, in_features, rows, b is not None)
    finally:
        torch.set_num_threads(saved)


@needs_native
@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_float32_packed_linear_on_native_panels_matches_f_linear_and_exports_its_weight(bias):
    gen = torch.Generator().manual_seed(2)
    dense = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(dense, native_f32=True)
    assert packed.packed_weight is None and "native panels" in packed.extra_repr()  # one copy of the weight
    for rows in (1, 4, 16, 17, 300):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.allclose(packed(x), F.linear(x, dense.weight, dense.bias), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 96, generator=gen)
    assert torch.allclose(packed(x3), F.linear(x3, dense.weight, dense.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, dense.weight.detach())
    state = packed.state_dict()
    assert sorted(state) == (["bias", "weight"] if bias else ["weight"])
    assert torch.equal(state["weight"], dense.weight.detach())


@needs_native
@needs_onednn
def test_a_loaded_float32_model_takes_the_native_panels_unless_turned_off(monkeypatch):
    monkeypatch.setenv("KVMESH_PACKED_LINEAR", "1")

    def num_native(loaded):
        linears = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
        assert linears
        return sum(m.panels is not None for m in linears), len(linears)

    monkeypatch.delenv("KVMESH_NATIVE_LINEAR", raising=False)
    on = load_model("tiny-llama")
    assert num_native(on)[0] == num_native(on)[1]
    monkeypatch.setenv("KVMESH_NATIVE_LINEAR", "0")
    off = load_model("tiny-llama")
    assert num_native(off)[0] == 0
    ours, theirs = on.model.hf_state_dict(), off.model.hf_state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
