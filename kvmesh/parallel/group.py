"""The collectives of one node's tensor-parallel ranks: an all-reduce per attention and per MLP, the
embedding's all-reduce, the logits' gather. A process group of its own (no ``torch.distributed`` default
group, so one process can hold several engines), gloo on the CPU and NCCL on CUDA, bound to loopback: a
node's ranks run on one machine. Every collective ends within ``timeout_s`` (raising) whatever its peers do.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from kvmesh.model.tp_shard import TensorParallelError

# A rank waits this long in one collective for the others (a dead or hung rank surfaces as an error).
DEFAULT_TIMEOUT_S = 60.0


def open_store(port: int, size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rank 0 makes the rendezvous store (``port`` 0: a free one, read back from ``.port``); the others join it."""
    return dist.TCPStore("127.0.0.1", port, size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "tp"):
        """Blocks until all ``size`` ranks have joined (or ``timeout_s``)."""
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.timeout_s = timeout_s
        self.collective_s = 0.0  # time this rank spent in collectives (issuing and waiting): their share of a step
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"{name}/", store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        if not x.is_contiguous():
            x = x.contiguous()
        self._run("all-reduce", lambda: self._pg.allreduce([x]))
        return x

    def _run(self, what: str, start) -> None:
        began = time.perf_counter()
        try:
            start().wait()
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection, or the timeout passed
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TensorParallelError(f"tensor-parallel rank {self.rank} of {self.size}: the {what} failed (a rank died "
                                      f"or did not answer within {self.timeout_s:g} s): {first}") from None
        finally:
            self.collective_s += time.perf_counter() - began

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` [rows, n] side by side [rows, n * size]; other ranks: None."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._run("gather", lambda: self._pg.gather([parts], [x], opts))
            return torch.cat(parts, dim=-1)
        self._run("gather", lambda: self._pg.gather([], [x], opts))
        return None

    def gather_stack(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` (all of one shape) stacked [size, ...]; other ranks: None."""
        parts = self.gather_columns(x.reshape(-1, 1))
        return None if parts is None else parts.t().reshape(self.size, *x.shape)

    def close(self) -> None:
        try:
            self._pg.shutdown()
        except (AttributeError, RuntimeError):
            pass
