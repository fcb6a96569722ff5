"""The native CPU kernels: compiled on first use for this machine, loaded through ctypes.

``load()`` compiles the C files beside this one (``decode_attention.c``, ``prefill_attention.c``, ``rms_norm.c``,
``rope_store.c``, ``greedy_pick.c``, ``linear_f32.c``; helpers in ``common.h``) into one
library with the system C compiler (``$CC``, else ``cc``/``gcc``) for the CPU it runs on
(``-march=native``) into ``$KVMESH_CACHE_DIR/native/`` (the file name carries a hash of the
sources, the flags, the compiler and the CPU's feature flags, so a changed source or another
machine builds afresh; concurrent processes each write a temporary file and rename it into place).
The library is built with OpenMP and links ``libgomp.so.1``, the runtime torch has already loaded,
so its threads are torch's pool; every call passes ``torch.get_num_threads()``, so
``torch.set_num_threads`` (``--threads``) bounds both, whichever thread calls.

Where no compiler or no build works, ``load()`` returns None once with the reason logged, and the
callers keep the torch reference kernels: the library is a speed-up, never a requirement.
``KVMESH_KERNELS=torch`` keeps the model on the torch kernels (see ``kernels/ops.py``). (The block
hash and the block pool's index are CPython extensions without torch: ``kernels/extensions``.)
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
from pathlib import Path

import numpy as np
import torch

from kvmesh.device import cpu_flags
from kvmesh.native_build import c_compiler, cache_dir, compile_library

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# -mtune=generic: GCC 12 tunes a Zen 4 as a Zen 3, which made C code such as the BLAKE2b chain
# (kernels/extensions) ~2.8x slower and these kernels no faster. -ffp-contract=off: no fused multiply-adds
# the C does not ask for, so fp32 results round as the torch references do.
FLAGS = ("-O3", "-march=native", "-mtune=generic", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off",
         "-fPIC", "-shared")
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    # each takes torch's intra-op thread count last (OpenMP's own default is per calling thread)
    "decode_attention": [_P, _P, _P, _I64, _I64, _P, _I64, _P, _INT, _INT, _INT, _INT, _INT, _F, _P, _INT],
    "prefill_attention": [_P, _P, _P, _I64, _I64, _P, _INT, _INT, _INT, _INT, _INT, _INT, _F, _P, _INT],
    "rms_norm": [_P, _P, _P, _I64, _I64, _F, _P, _INT],
    "rope_store": [_P, _I64, _INT, _INT, _INT, _P, _P, _P, _P, _I64, _I64, _P, _P, _P, _INT],
}
_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_FLOAT32_ONLY = {"greedy_pick_f32": [_P, _I64, _I64, _P, _P, _INT],
                 "linear_pack_f32": [_P, _I64, _I64, _P],
                 "linear_f32": [_P, _I64, _I64, _P, _I64, _P, _P, _INT]}


class NativeKernelError(RuntimeError):
    """A native kernel refused its arguments (status -2) or ran out of memory (-1)."""


def _build(compiler: str, out: Path) -> str | None:
    """Compile into ``out``; returns None, or why it failed (OpenMP is dropped if it alone fails)."""
    error = ""
    for openmp in (("-fopenmp",), ()):
        error = compile_library(compiler, [*FLAGS, *openmp], [*map(str, SOURCES), "-lm"], out)
        if error is None or error.startswith("cannot write"):
            return error
    return error


@functools.cache
def _library_path() -> Path | None:
    """The compiled library for this machine, building it if needed; None (reason logged once) if none."""
    compiler = c_compiler()
    if compiler is None:
        log.info("native CPU kernels off: no C compiler (set CC); using the torch kernels")
        return None
    key = hashlib.blake2b(digest_size=8)
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(FLAGS).encode(), compiler.encode(),
                 " ".join(cpu_flags() or [platform.processor()]).encode()):
        key.update(part)
    path = cache_dir() / f"kvmesh_cpu_{key.hexdigest()}.so"
    if not path.exists():
        log.info("building the native CPU kernels for this machine into %s (once)", path.parent)
        reason = _build(compiler, path)
        if reason is not None:
            log.warning("native CPU kernels off (using the torch kernels): %s", reason)
            return None
    return path


def _open(loader: type[ctypes.CDLL]) -> ctypes.CDLL | None:
    path = _library_path()
    if path is None:
        return None
    try:
        return loader(str(path))
    except OSError as exc:
        log.warning("native CPU kernels off (using the torch kernels): %s", exc)
        return None


def _declare(lib: ctypes.CDLL, signatures: dict[str, list], suffixes: tuple[str, ...] = ("",),
             restype: type = ctypes.c_int) -> None:
    """Give each function ``name`` (or ``name_suffix``) its argument and result types."""
    for name, argtypes in signatures.items():
        for suffix in suffixes:
            fn = getattr(lib, f"{name}_{suffix}" if suffix else name)
            fn.argtypes, fn.restype = argtypes, restype


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels (each call releases the GIL); None (reason logged once) where they cannot be had."""
    lib = _open(ctypes.CDLL)
    if lib is not None:
        _declare(lib, _SIGNATURES, tuple(_SUFFIXES.values()))
        _declare(lib, _FLOAT32_ONLY)
        _declare(lib, {"linear_f32_available": []})
        _declare(lib, {"linear_packed_numel": [_I64, _I64]}, restype=_I64)
    return lib


def forget() -> None:
    """Forget the loaded library and its path, so the next ``load`` looks again (tests that build variants)."""
    for cached in (_library_path, load):
        cached.cache_clear()


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as a contiguous ``dtype`` tensor, without a dispatch when it already is one (per-layer calls)."""
    return tensor if tensor.dtype == dtype and tensor.is_contiguous() else tensor.to(dtype).contiguous()


def _is_layer_view(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """One layer's K and V of the block-major buffer: [blocks, block_size, H_kv, D], each position's heads
    contiguous; positions ``stride(1)`` apart (further than H_kv * D for a tensor-parallel rank's heads of a buffer
    of every head)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
            and tuple(k_cache.stride()[2:]) == (head_dim, 1) and k_cache.stride(1) >= num_kv_heads * head_dim)


def can_attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` and ``prefill_attention`` take these tensors (side-effect free apart from
    building once)."""
    if query.device.type != "cpu" or query.dtype not in _SUFFIXES or k_cache.dtype != query.dtype:
        return False
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (head_dim % 16 == 0 and query.shape[1] % num_kv_heads == 0 and _is_layer_view(k_cache, v_cache)
            and query.is_contiguous() and load() is not None)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence: query [B, Hq, D] -> [B, Hq, D], reading K/V from the paged caches.

    Same contract and roundings as ``reference.attention.decode_attention``; check ``can_attend`` first.
    ``block_tables`` [B, max_blocks] and ``seq_lens`` [B] are converted to contiguous int32 if needed.
    """
    lib = load()
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables, lens = _as(block_tables, torch.int32), _as(seq_lens, torch.int32)
    out = torch.empty_like(query)
    status = getattr(lib, f"decode_attention_{_SUFFIXES[query.dtype]}")(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
        scale, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise NativeKernelError(f"decode_attention returned {status} for query {tuple(query.shape)}, "
                                f"cache {tuple(k_cache.shape)}")
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_lens: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context: query [T, Hq, D] (the
    sequences' new tokens back to back) -> [T, Hq, D], K/V read in place from the paged caches.

    The roundings of ``reference.attention.chunked_causal_attention``; check ``can_attend`` first.
    """
    lib = load()
    fn = getattr(lib, f"prefill_attention_{_SUFFIXES[query.dtype]}")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = _as(block_tables, torch.int32)
    out = torch.empty_like(query)
    start, row_bytes = 0, num_heads * head_dim * query.element_size()
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        status = fn(query.data_ptr() + start * row_bytes, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                    k_cache.stride(1), tables[i].data_ptr(), s_len - q_len, q_len, num_heads, num_kv_heads, head_dim,
                    block_size, scale, out.data_ptr() + start * row_bytes, torch.get_num_threads())
        if status != 0:
            raise NativeKernelError(f"prefill_attention returned {status} for {q_len} tokens over {s_len}, "
                                    f"query {tuple(query.shape)}, cache {tuple(k_cache.shape)}")
        start += q_len
    return out


def can_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``rms_norm`` takes these tensors (side-effect free apart from building once)."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        return False
    return (x.device.type == "cpu" and x.dtype in _SUFFIXES and weight.dtype == x.dtype and x.is_contiguous()
            and weight.is_contiguous() and x.shape[-1] == weight.shape[0] and load() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * rms_norm(x)`` over the last dim, rounded as ``model.layers.RMSNorm`` does; check ``can_norm``.

    With ``residual`` (same shape and dtype, contiguous), ``x`` becomes ``x + residual`` **in place**
    first and the norm is taken of that: the fused residual add of a decoder layer.
    """
    if residual is not None and not can_norm(x, weight, residual):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    out = torch.empty_like(x)
    dim = x.shape[-1]
    getattr(load(), f"rms_norm_{_SUFFIXES[x.dtype]}")(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), x.numel() // dim, dim,
        eps, out.data_ptr(), torch.get_num_threads())
    return out


def can_rope_store(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``rope_store`` takes these tensors (side-effect free apart from building once)."""
    if qkv.device.type != "cpu" or qkv.dtype not in _SUFFIXES or not cos.dtype == k_cache.dtype == qkv.dtype:
        return False
    head_dim = k_cache.shape[3]  # cos: [T, D] or lookup's [T, 1, D], one contiguous row per token
    return (qkv.is_contiguous() and cos.is_contiguous() and cos.numel() == qkv.shape[0] * head_dim
            and _is_layer_view(k_cache, v_cache) and load() is not None)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate the queries and keys of a fused projection ``qkv`` [T, (Hq + 2 Hkv) * D] with ``cos`` /
    ``signed_sin`` ([T, D] or [T, 1, D], contiguous); store the keys and values at slots (``block_ids``,
    ``offsets``, int64 [T]) of one layer's caches; returns the queries [T, Hq, D]. Same values as
    ``model.rope.rotate`` then ``store_kv_at``; check ``can_rope_store`` first."""
    num_tokens = qkv.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    ids, offs = _as(block_ids, torch.int64), _as(offsets, torch.int64)
    status = getattr(load(), f"rope_store_{_SUFFIXES[qkv.dtype]}")(
        qkv.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, cos.data_ptr(), signed_sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), ids.data_ptr(), offs.data_ptr(),
        q.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise NativeKernelError(f"rope_store returned {status} for qkv {tuple(qkv.shape)}, head_dim {head_dim}")
    return q


def greedy_pick(logits: np.ndarray) -> tuple[list[int], list[float]] | None:
    """Each row's first maximum and its logprob under log_softmax, for logits [rows, vocab] float32 (C order, as
    ``tensor.numpy()`` gives a contiguous tensor): (token ids, -1 where a row holds a NaN or an infinity;
    logprobs). None where the library is not built (the caller keeps its own path)."""
    lib = load()
    if lib is None:
        return None
    rows, vocab = logits.shape
    ids, logprobs = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.float64)
    lib.greedy_pick_f32(logits.ctypes.data, rows, vocab, ids.ctypes.data, logprobs.ctypes.data,
                        torch.get_num_threads())
    return ids.tolist(), logprobs.tolist()


def has_linear() -> bool:
    """Whether ``pack_linear`` / ``linear`` run here: the library built, for a CPU with AVX2 and FMA."""
    lib = load()
    return lib is not None and lib.linear_f32_available() == 1


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [n, k] packed for ``linear``: a new tensor [ceil(n / 16), k, 16] (output columns past
    n zero); check ``has_linear`` first."""
    lib = load()
    dense = _as(weight.detach(), torch.float32)
    n, k = dense.shape
    packed = torch.empty(lib.linear_packed_numel(n, k), dtype=torch.float32)
    status = lib.linear_pack_f32(dense.data_ptr(), n, k, packed.data_ptr())
    if status != 0:
        raise NativeKernelError(f"linear_pack returned {status} for a weight {tuple(dense.shape)}")
    return packed.view(-1, k, 16)


def unpack_linear(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense weight [out_features, k] of a ``pack_linear`` result (a new tensor; for exports and checks)."""
    panels, in_features, width = packed.shape
    return packed.permute(0, 2, 1).reshape(panels * width, in_features)[:out_features].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for a contiguous float32 ``x`` [m, k], W packed by ``pack_linear`` and ``bias`` float32
    contiguous (or None). Returns a new [m, out_features] tensor."""
    rows, in_features = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32)
    status = load().linear_f32(x.data_ptr(), rows, in_features, packed.data_ptr(), out_features,
                               None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise NativeKernelError(f"linear_f32 returned {status} for x {tuple(x.shape)}, {out_features} outputs")
    return y
