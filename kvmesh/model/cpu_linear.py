"""Linear layers with their weights pre-packed once, for the fast CPU matmul paths.

``F.linear`` on the CPU re-lays-out the weight on every call (bf16) or goes through
MKL's sgemm (fp32, which on AMD CPUs picks slow code paths). Packing each weight
once into oneDNN's blocked layout and calling oneDNN directly measured, on 2 EPYC
cores with SmolLM2-135M shapes: 1.4x faster at decode batch sizes in bf16 and
2.2x faster at every batch size in fp32. Results are bit-identical in bf16 and
equal to rounding in fp32 (accumulation order).

``pack_linears(model)`` swaps every ``nn.Linear`` of a CPU model for a
``PackedLinear`` in place; ``state_dict()`` still yields the dense weights (so
``hf_state_dict`` and reference models keep working). A tied head gets its own
packed copy, the embedding keeps the dense table. oneDNN's layout not on CPUs with AMX,
where it measured slower (``can_pack``); the native float32 panels below everywhere they
are built. ``KVMESH_PACKED_LINEAR=0`` turns packing off, ``=1`` forces it (for A/B runs).

A float32 weight is packed instead into the panels of the native kernel ``kernels/cpu/linear_f32.c``
where the CPU has AVX2 and FMA (``has_linear``): a decode step's few rows are the time to read the
weights from memory, which it reads at the machine's rate and oneDNN's packed path at well under it,
and its many-row products keep pace with oneDNN's. ``KVMESH_NATIVE_LINEAR=0`` keeps oneDNN (A/B runs).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kvmesh.device import cpu_features
from kvmesh.kernels.cpu import library as native

#: The batch size oneDNN tunes the packed layout for: decode batches (larger batches run as fast).
PACKING_BATCH_HINT = 16


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing is available and wanted: float32 weights into the native kernel's panels wherever it is
    built (AMX or not: AMX has no float32 tiles, and ``F.linear``'s sgemm reads a decode step's weights slower
    than the panels do); otherwise oneDNN's layout on a CPU without AMX, for a dtype it packs.

    On a CPU with AMX tiles (an Intel Sapphire Rapids, 16 threads) oneDNN packing measured 1.85x *slower*
    in a batch-16 bf16 decode (393 vs 728 tok/s): there ``F.linear`` already reaches oneDNN's AMX
    kernels, while the packed path does not. ``KVMESH_PACKED_LINEAR=1`` forces it, ``=0`` turns it off.
    """
    forced = os.environ.get("KVMESH_PACKED_LINEAR", "")
    if forced == "0" or device.type != "cpu":
        return False
    if dtype == torch.float32 and native_linear_wanted():
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if forced != "1" and "amx_tile" in cpu_features():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_linear_wanted() -> bool:
    """Whether float32 linears take the native panel kernel here (built for this CPU, not turned off)."""
    return os.environ.get("KVMESH_NATIVE_LINEAR", "") != "0" and native.has_linear()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held packed (read-only after packing): in the native kernel's panels (float32,
    ``native_f32=True``) or in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACKING_BATCH_HINT, native_f32: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if native_f32:
            self.panels, self.packed_weight = native.pack_linear(linear.weight), None
        else:
            self.panels = None
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight (for exports and checks; not on the hot path)."""
        if self.panels is not None:
            return native.unpack_linear(self.panels, self.out_features)
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features).contiguous()
        y = native.linear(rows, self.panels, self.out_features, self.bias)  # (only its data pointer is read)
        return y.view(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 (torch's signature)
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        layout = "native panels" if self.panels is not None else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={layout}"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``model`` by a ``PackedLinear``; returns how many were packed.

    Call once, after the weights are loaded and before serving; the dense weights are released
    (except those shared with another module, e.g. a tied embedding). Float32 weights go to the native
    kernel's panels where ``native_linear_wanted``.
    """
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    native_f32 = native_linear_wanted()
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, native_f32=native_f32 and child.weight.dtype == torch.float32))
    return len(targets)
