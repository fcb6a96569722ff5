"""One engine over ``size`` tensor-parallel ranks: rank 0 is the caller's process (scheduler, sampling, the
world), ranks 1.. are processes it starts (``kvmesh/parallel/rank_main.py``) that hold their part of the
model and only run forwards.

Rank 0's engine calls ``TensorParallelModel`` as it calls a model. Each call is first sent to the other ranks
over their stdin pipes (a step's inputs: token ids, positions, attention metadata), then every rank runs it
together, meeting in the model's collectives (``kvmesh/parallel/group.py``); logits are gathered to rank 0.
Between steps the other ranks wait on their pipes, which cannot time out; inside a step every collective does
(a dead or hung rank fails the step with an error, never a hang). The other ranks die with rank 0 (a closed
pipe, or the kernel's parent-death signal); a rank that exits before ``close`` calls ``on_rank_lost``.

The KV cache on the CPU (``shares_kv``): one buffer of every KV head, the format a size-1 engine keeps and
what transfers, tiers and probes read (docs/design.md §3), in shared memory that every rank maps
(``attach_kv``); each rank reads and writes the heads it holds through a view of it. On CUDA each rank keeps
a buffer of its own heads on its device.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from kvmesh.device import resolve_device
from kvmesh.lifecycle import die_with_parent
from kvmesh.model.config import parse_dtype
from kvmesh.model.loader import load_model
from kvmesh.model.card import load_tokenizer
from kvmesh.model.tp_shard import TensorParallelError, TPShard, check_tp_size
from kvmesh.parallel.group import DEFAULT_TIMEOUT_S, TPGroup, open_store


def metadata_on(md, device: torch.device | str):
    """Attention metadata with its tensors on ``device`` and its per-step caches dropped: rank 0 sends it with
    its tensors on the host, the other ranks move them to their device."""
    changes = {f.name: getattr(md, f.name).to(device) for f in dataclasses.fields(md)
               if isinstance(getattr(md, f.name), torch.Tensor)}
    return dataclasses.replace(md, per_step={}, **changes)


def head_slice(config, rank: int, size: int) -> slice:
    """The KV heads rank ``rank`` holds, as a slice of a whole model's heads (consecutive: ``TPShard``)."""
    ids = TPShard(config, rank, size).kv_head_ids
    return slice(ids[0], ids[-1] + 1)


class TensorParallelModel:
    """Rank 0's model: the engine's calls, run by every rank. ``config`` is rank 0's part; ``kv_config`` sizes
    the engine's KV buffer (every head where the ranks share it, else rank 0's)."""

    def __init__(self, local, ranks: TensorParallelRanks, whole_config):
        self.local = local
        self.config = local.config
        self._ranks = ranks
        self._whole = whole_config
        self.shares_kv = ranks.devices[0].type == "cpu"
        self.kv_config = whole_config if self.shares_kv else local.config
        self._heads = head_slice(whole_config, 0, ranks.size)
        self._attached: torch.Tensor | None = None

    def attach_kv(self, kv_buffer: torch.Tensor, region) -> None:
        """Every other rank maps ``kv_buffer`` (every head, in the memfd ``region`` describes:
        ``kvmesh/kv/shared_buffer.py``) and reads and writes its heads there from the next call on."""
        self._ranks.send(("map_kv", region.encode(), tuple(kv_buffer.shape), kv_buffer.dtype))
        self._ranks.read_status("mapped")
        self._attached = kv_buffer

    def _mine(self, kv_buffer: torch.Tensor) -> torch.Tensor:
        if not self.shares_kv:
            return kv_buffer
        if kv_buffer is not self._attached:
            raise TensorParallelError("the ranks share a KV buffer only after attach_kv")
        return kv_buffer[..., self._heads, :]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_buffer: torch.Tensor, md,
                 num_layers: int | None = None) -> torch.Tensor:
        mine = self._mine(kv_buffer)
        self._ranks.send(("forward", input_ids.cpu(), positions.cpu(), tuple(kv_buffer.shape), kv_buffer.dtype,
                          metadata_on(md, "cpu"), num_layers))
        return self.local(input_ids, positions, mine, md, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._ranks.send(("logits", hidden.cpu()))
        return self.local.compute_logits(hidden)

    def read_kv(self, kv_buffer: torch.Tensor, block_ids: list[int]) -> list[torch.Tensor]:
        """Each rank's KV of ``block_ids`` ([blocks, layers, 2, block_size, its KV heads, head_dim], rank order):
        what the KV oracle compares with a whole model's heads (``TPShard.kv_head_ids``)."""
        if self.shares_kv:  # every head is here: read each rank's through its view
            blocks = kv_buffer[torch.tensor(block_ids)]
            return [blocks[..., head_slice(self._whole, r, self._ranks.size), :].clone()
                    for r in range(self._ranks.size)]
        self._ranks.send(("read_kv", list(block_ids)))
        mine = kv_buffer[torch.tensor(block_ids, device=kv_buffer.device)].cpu()
        return list(self.local.group.gather_stack(mine).unbind(0))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        raise TensorParallelError("a tensor-parallel model's weights are spread over its ranks: export at size 1")


class TensorParallelRanks:
    """Starts ranks 1..size-1, joins them in one group, loads rank 0's part. ``close`` (also at garbage
    collection and exit) stops them."""

    def __init__(self, model: str, size: int, *, dtype: str = "float32", device: str = "cpu",
                 load_format: str = "auto", progress: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 num_threads: int = 0):
        """``num_threads``: the CPU threads of all ranks together (0: every core), split between them."""
        check_tp_size(load_tokenizer(model).config, size)  # before any rank starts
        self.size = size
        self._lock = threading.Lock()
        self._threads_before = 0
        self._closing = threading.Event()  # set by close (and the exit-time finalizer): ranks exit as asked
        self.on_rank_lost: Callable[[str], None] | None = None  # called once (a watcher thread) with what happened
        self.devices = devices = rank_devices(resolve_device(device) if isinstance(device, str)
                                              else torch.device(device), size)
        dtype_name = str(parse_dtype(dtype, devices[0])).removeprefix("torch.")
        threads = max(1, (num_threads or os.cpu_count() or 1) // size)  # on the CPU the ranks split the cores
        store = open_store(0, size, True, timeout_s)
        init = {"model": model, "dtype": dtype_name, "load_format": load_format, "size": size, "port": store.port,
                "timeout_s": timeout_s, "threads": threads}
        self._procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._closing)
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", "kvmesh.parallel.rank_main"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, preexec_fn=die_with_parent())
                self._procs.append(proc)
                pickle.dump({**init, "rank": rank, "device": str(devices[rank])}, proc.stdin)
                proc.stdin.flush()
            if devices[0].type == "cpu":
                self._threads_before = torch.get_num_threads()  # given back by close
                torch.set_num_threads(threads)
            self.read_status("joining")
            self.group = TPGroup(store, 0, size, devices[0], timeout_s)
            loaded = load_model(model, dtype=dtype_name, device=devices[0], progress=progress,
                                load_format=load_format, tp=(0, size, self.group))
            self.read_status("ready")
        except BaseException:
            self.close()
            raise
        self.loaded = dataclasses.replace(loaded, model=TensorParallelModel(loaded.model, self, loaded.config))
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"kvmesh-tp-rank{rank}", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        status = proc.wait()
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()  # one report, however many ranks go
        if self.on_rank_lost is not None:
            self.on_rank_lost(f"tensor-parallel rank {rank} exited with status {status}")

    def read_status(self, expected: str) -> None:
        """Each other rank's next status line; raises on an error line or a rank that exited."""
        for rank, proc in enumerate(self._procs, start=1):
            line = proc.stdout.readline()
            reply = json.loads(line) if line else {"error": f"exited with status {proc.wait()}"}
            if expected not in reply:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {reply.get('error', reply)}")

    def send(self, message: tuple) -> None:
        """Hands one call to every other rank (in the order rank 0 makes its calls)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    raise TensorParallelError(f"tensor-parallel rank {rank} is gone (exit status {proc.returncode})")
                try:
                    proc.stdin.write(data)
                    proc.stdin.flush()
                except (BrokenPipeError, ValueError):
                    raise TensorParallelError(f"tensor-parallel rank {rank} is gone "
                                              f"(exit status {proc.poll()})") from None

    def close(self) -> None:
        """Stops the other ranks and gives this process its compute threads back (idempotent)."""
        self._finalizer()
        group = getattr(self, "group", None)
        if group is not None:
            group.close()
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = 0


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """The device of each rank: the CPU for all, or one CUDA device each from ``device``'s index on."""
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise TensorParallelError(f"tensor-parallel size {size} from {device} needs {first + size} CUDA devices, "
                                  f"this machine shows {torch.cuda.device_count()}")
    return [torch.device("cuda", first + rank) for rank in range(size)]


def _stop(procs: list[subprocess.Popen], closing: threading.Event) -> None:
    closing.set()
    for proc in procs:
        try:
            proc.stdin.close()  # a rank ends when its pipe does
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
