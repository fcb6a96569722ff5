"""Linear layers with their weights pre-packed for oneDNN, the fast CPU matmul path.

``F.linear`` on the CPU re-lays-out the weight on every call (bf16) or goes through
MKL's sgemm (fp32, which on AMD CPUs picks slow code paths). Packing each weight
once into oneDNN's blocked layout and calling oneDNN directly measured, on 2 EPYC
cores with SmolLM2-135M shapes: 1.4x faster at decode batch sizes in bf16 and
2.2x faster at every batch size in fp32. Results are bit-identical in bf16 and
equal to rounding in fp32 (accumulation order).

``pack_linears(model)`` swaps every ``nn.Linear`` of a CPU model for a
``PackedLinear`` in place; ``state_dict()`` still yields the dense weights (so
``hf_state_dict`` and reference models keep working). A tied head gets its own
packed copy, the embedding keeps the dense table. Not on CPUs with AMX, where it
measured slower (``can_pack``). ``KVMESH_PACKED_LINEAR=0`` turns packing off, ``=1``
forces it (for A/B runs).

A float32 linear also keeps its weight in the native skinny layout (``kernels/cpu/skinny_linear.c``)
where the CPU has AVX2 and FMA: calls of at most ``SKINNY_MAX_ROWS`` rows (decode steps) take it, since
oneDNN's packed path streams the weight from memory at well under the machine's read rate when only a
few rows multiply it; more rows (prompts) stay on oneDNN. That is a second copy of the weights:
``pack_linears`` leaves it out where it would take more than ``SKINNY_MAX_MEMORY_SHARE`` of the memory
available, and ``KVMESH_SKINNY_LINEAR=0`` turns it off (for A/B runs).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kvmesh.kernels.cpu import library as native
from kvmesh.device import cpu_features

#: The batch size oneDNN tunes the packed layout for: decode batches (larger batches run as fast).
PACKING_BATCH_HINT = 16
#: Calls of at most this many rows take the skinny kernel (measured no slower than oneDNN up to 16 rows here).
SKINNY_MAX_ROWS = 16
#: The skinny copies of a model's weights may take at most this share of the memory available when it loads.
SKINNY_MAX_MEMORY_SHARE = 0.25


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing is available and wanted: CPU without AMX, oneDNN built in, a dtype it packs.

    On a CPU with AMX tiles (an Intel Sapphire Rapids, 16 threads) packing measured 1.85x *slower*
    in a batch-16 bf16 decode (393 vs 728 tok/s): there ``F.linear`` already reaches oneDNN's AMX
    kernels, while the packed path does not. ``KVMESH_PACKED_LINEAR=1`` forces it, ``=0`` turns it off.
    """
    forced = os.environ.get("KVMESH_PACKED_LINEAR", "")
    if forced == "0" or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if forced != "1" and "amx_tile" in cpu_features():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (read-only after packing)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACKING_BATCH_HINT, skinny: bool = False):
        """``skinny``: also keep the float32 weight in the skinny kernel's layout (check ``can_skinny``)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias
        self.skinny_weight = native.skinny_pack(linear.weight) if skinny else None

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight (for exports and checks; not on the hot path)."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny_weight is not None and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.is_contiguous():
            bias = None if self.bias is None else self.bias.detach()
            return native.skinny_linear(x, self.skinny_weight, self.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 (torch's signature)
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        packed = "onednn+skinny" if self.skinny_weight is not None else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={packed}"


def can_skinny(weight_bytes: int) -> bool:
    """Whether float32 linears of ``weight_bytes`` in all also get skinny copies here: the kernel built for
    this CPU, not turned off (``KVMESH_SKINNY_LINEAR=0``), and the copies within their share of the memory
    available."""
    if os.environ.get("KVMESH_SKINNY_LINEAR", "") == "0" or not native.can_skinny():
        return False
    return weight_bytes <= SKINNY_MAX_MEMORY_SHARE * _available_memory_bytes()


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``model`` by a ``PackedLinear``; returns how many were packed.

    Call once, after the weights are loaded and before serving; the dense weights are released
    (except those shared with another module, e.g. a tied embedding). Float32 linears also get skinny
    copies for decode steps where ``can_skinny`` says so.
    """
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    float32_bytes = sum(child.weight.numel() * 4 for _, _, child in targets if child.weight.dtype == torch.float32)
    skinny = float32_bytes > 0 and can_skinny(float32_bytes)
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, skinny=skinny and child.weight.dtype == torch.float32))
    return len(targets)
