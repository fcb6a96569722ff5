"""A tensor-parallel rank other than 0 (``python -m kvmesh.parallel.rank_main``, started by
``kvmesh/parallel/ranks.py``): joins the group, loads its part of the model, then runs every call rank 0
sends over stdin until the pipe closes. Writes one JSON line to stdout once loaded: ``{"ready": rank}``,
or ``{"error": ...}`` when it cannot start."""
from __future__ import annotations

import json
import pickle
import sys

import torch


def serve(init: dict, calls, status) -> None:
    """Load and run calls until ``calls`` ends."""
    from kvmesh.model.loader import load_model
    from kvmesh.parallel.group import TPGroup, open_store
    from kvmesh.parallel.ranks import metadata_on

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
            elif call[0] == "logits":
                model.compute_logits(call[1].to(device))
            elif call[0] == "read_kv":
                (kv,) = kv_buffers.values()
                group.gather_stack(kv[torch.tensor(call[1], device=device)].cpu())
            else:
                raise ValueError(f"unknown call {call[0]!r}")


def main() -> int:
    calls = sys.stdin.buffer
    init = pickle.load(calls)
    serve(init, calls, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
