"""A tensor-parallel rank other than 0 (``python -m kvmesh.parallel.rank_main``, started by
``kvmesh/parallel/ranks.py``): joins the group, loads its part of the model, then runs every call rank 0
sends over stdin until the pipe closes. Writes one JSON line to stdout once loaded: ``{"ready": rank}``,
or ``{"error": ...}`` when it cannot start."""
from __future__ import annotations

import json
import math
import pickle
import sys

import torch


def serve(init: dict, calls, status) -> None:
    """Load and run calls until ``calls`` ends."""
    from kvmesh.model.loader import load_model
    from kvmesh.parallel.group import TPGroup, open_store
    from kvmesh.parallel.ranks import head_slice, metadata_on

    def say(**line) -> None:
        status.write(json.dumps(line) + "\n")
        status.flush()

    try:
        device = torch.device(init["device"])
        if device.type == "cpu":
            torch.set_num_threads(init["threads"])
        elif device.type == "cuda":
            torch.cuda.set_device(device)
    except Exception as e:
        say(error=f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    say(joining=init["rank"])  # rank 0 now waits in the rendezvous (until its timeout) for this rank
    store = open_store(init["port"], init["size"], False, init["timeout_s"])
    group = TPGroup(store, init["rank"], init["size"], device, init["timeout_s"])
    try:
        loaded = load_model(init["model"], dtype=init["dtype"], device=device, progress=False,
                            load_format=init["load_format"], tp=(init["rank"], init["size"], group))
    except Exception as e:
        say(error=f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    say(ready=init["rank"])
    model, kv_buffers = loaded.model, {}
    heads = head_slice(loaded.config, init["rank"], init["size"])
    with torch.inference_mode():
        while True:
            try:
                call = pickle.load(calls)
            except EOFError:
                return
            if call[0] == "forward":
                _, input_ids, positions, shape, dtype, md, num_layers = call
                if (shape, dtype) not in kv_buffers:  # rank 0's buffer shape: every rank holds as many heads
                    kv_buffers.clear()
                    kv_buffers[(shape, dtype)] = torch.zeros(shape, dtype=dtype, device=device)
                md = metadata_on(md, device)
                model(input_ids.to(device), positions.to(device), kv_buffers[(shape, dtype)], md, num_layers)
            elif call[0] == "map_kv":  # rank 0's buffer of every head (the CPU): this rank's heads are a view of it
                _, region, shape, dtype = call
                try:
                    whole = map_shared_kv(region, shape, dtype)
                except (OSError, ValueError) as e:
                    say(error=f"cannot map rank 0's KV buffer: {e}")
                    raise SystemExit(1) from None
                kv_buffers.clear()
                kv_buffers[(shape, dtype)] = whole[..., heads, :]
                say(mapped=init["rank"])
            elif call[0] == "logits":
                model.compute_logits(call[1].to(device))
            elif call[0] == "read_kv":
                (kv,) = kv_buffers.values()
                group.gather_stack(kv[torch.tensor(call[1], device=device)].cpu())
            else:
                raise ValueError(f"unknown call {call[0]!r}")


def map_shared_kv(region_text: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV buffer rank 0 allocated in a memfd (``kvmesh/kv/shared_buffer.py``), mapped here."""
    import mmap
    import os

    from kvmesh.kv.shared_buffer import SharedRegion, open_region

    region = SharedRegion.decode(region_text)
    if region is None:
        raise ValueError(f"malformed region {region_text!r}")
    fd = open_region(region)
    try:
        mapping = mmap.mmap(fd, region.num_bytes)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype)
    if tensor.numel() != math.prod(shape):
        raise ValueError(f"region of {region.num_bytes} bytes for a buffer of shape {shape}")
    return tensor.view(*shape)


def main() -> int:
    calls = sys.stdin.buffer
    init = pickle.load(calls)
    serve(init, calls, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
