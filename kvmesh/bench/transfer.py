"""``kvmesh bench transfer``: KV pushes between two real processes, against this machine's ceilings.

In one run: memcpy bandwidth (numpy, 64 MiB), a plain TCP socket stream over
loopback between two processes (the ceiling any TCP transport can reach), then
for each backend a sweep of push sizes from 1 block to 64 MiB with contiguous
block ids (one descriptor) and scattered ones (one descriptor per block). Backend
``shared-memory``: the requester's KV buffer is a memfd that the holder (same host)
writes by one copy (``transfer/shared_memory.py``; its side channel is zmq's). Each
figure is the end-to-end push as a requester sees it: side-channel request,
holder match + pin, the batched write, the final answer; beside it, for a
one-sided engine, its parts: the wire alone (the holder's bare engine write of the
same descriptors into our landing slots, no conversation, no fence) and the fence
(copy out of the slots and check, one pass per block).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import zlib

import numpy as np
import torch
from tqdm import tqdm

from kvmesh.auth import TOKEN_ENV, ClusterAuth, generate_token
from kvmesh.bench.report import machine, print_table, write_json
from kvmesh.cluster.node_forkserver import ForkedProcess, start_module
from kvmesh.kv import fast_crc
from kvmesh.kv.block_pool import BlockPool
from kvmesh.transfer.coalesce import coalesce, to_descriptors
from kvmesh.transfer.engine import create_transfer_engine, mooncake_available
from kvmesh.transfer.kv_agent import TransferAgent
from kvmesh.transfer.peers import PeerRecord, StaticPeers
from kvmesh.transfer.peer_process import chain_hashes
from kvmesh.kv.shared_buffer import SharedKVAllocator

SHARED_MEMORY = "shared-memory"

_TOKEN = generate_token()  # shared with the holder processes this benchmark starts

BLOCK_ELEMS = 64 * 1024  # 256 KiB fp32 blocks
BLOCK_BYTES = BLOCK_ELEMS * 4
SIZES_BLOCKS = (1, 4, 16, 64, 256)  # 256 KiB ... 64 MiB
GIB = 2**30
LINK_100GBIT_GIB_PER_S = 100e9 / 8 / GIB


def memcpy_gib_per_s(nbytes: int = 64 * 2**20, repeat: int = 5) -> float:
    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / GIB


def check_path_gib_per_s(nbytes: int = 64 * 2**20, repeat: int = 3) -> dict:
    """One core's rates: crc32 of bytes in memory (the node's checksum, ``kvmesh/kv/fast_crc.py``, and zlib's), and
    the landing fence's step (copy a block, crc32 it while it is in cache) block by block."""
    src, dst = torch.ones(nbytes // BLOCK_BYTES, BLOCK_BYTES, dtype=torch.uint8), \
        torch.empty(nbytes // BLOCK_BYTES, BLOCK_BYTES, dtype=torch.uint8)
    src_addrs = [src[i].data_ptr() for i in range(src.shape[0])]
    dst_addrs = [dst[i].data_ptr() for i in range(dst.shape[0])]
    times: dict[str, list[float]] = {"crc32": [], "zlib_crc32": [], "copy_and_crc32": []}
    for _ in range(repeat + 1):
        for name, fn in (("crc32", lambda: fast_crc.crc32_at(src_addrs, BLOCK_BYTES)),
                         ("zlib_crc32", lambda: zlib.crc32(src.numpy())),
                         ("copy_and_crc32", lambda: fast_crc.copy_crc32_at(dst_addrs, src_addrs, BLOCK_BYTES))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {f"{name}_gib_per_s": nbytes / statistics.median(t[1:]) / GIB for name, t in times.items()}
    out["native"] = fast_crc.available()
    return out


_SINK = """
import socket, sys
srv = socket.create_server(("127.0.0.1", 0)); print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); buf = bytearray(1 << 22); view = memoryview(buf)
while True:
    n = conn.recv_into(view)
    if n == 0: break
    if buf[n - 1] == 255: conn.sendall(b"k")
"""


def socket_gib_per_s(nbytes: int = 64 * 2**20, repeat: int = 5) -> float:
    """A plain TCP stream to another process over loopback; the sink acks each message's last byte."""
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        payload = bytearray(nbytes)
        payload[-1] = 255
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(repeat + 1):
                start = time.perf_counter()
                conn.sendall(payload)
                conn.recv(1)
                times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times[1:]) / GIB
    finally:
        sink.kill()
        sink.wait()


def _holder(backend: str, num_blocks: int, contiguous: bool, requester: TransferAgent,
            token: str) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """A holder process that trusts ``requester``; returns it and its node id (added to our directory)."""
    args = ["--backend", backend, "--num-blocks", str(num_blocks), "--chain", str(num_blocks), "--block-elems",
            str(BLOCK_ELEMS), "--requester", json.dumps(dataclasses.asdict(requester.record))]
    if requester.shared_writer is not None or requester.record.shared_memory:
        args.append("--shared-memory")  # its process is then known to us: our fence for its in-place copies
    proc = start_module("kvmesh.transfer.peer_process", args + (["--contiguous"] if contiguous else []),
                        {**os.environ, TOKEN_ENV: token}, secret_env=(TOKEN_ENV,), stderr=subprocess.DEVNULL)
    record = PeerRecord(**json.loads(proc.stdout.readline())["record"])
    requester.requester.directory.add(record)
    return proc, record.node_id


SHORT_PUSHES_FOR_S = 60.0  # how long a size may keep getting short pushes (a loaded machine) before the bench fails


def _push(agent: TransferAgent, peer: str, dst: list[int], hashes: list[bytes], timeout_s: float) -> int:
    outcome = agent.requester.push(peer, dst, hashes, request_id="bench", timeout_s=timeout_s)
    if outcome.error is not None:
        raise outcome.error
    return outcome.num_written


def _wire_seconds(proc: subprocess.Popen | ForkedProcess, num_blocks: int, repeat: int, requester_id: str) -> float | None:
    """The holder's bare engine write of the same blocks into our landing slots (None: not a one-sided engine)."""
    proc.stdin.write(f"wire {num_blocks} {repeat} {requester_id}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["wire_s"]


def bench_backend(backend: str, repeat: int, bar: tqdm, token: str = _TOKEN,
                  landing_chunk_bytes: int = -1) -> list[dict]:
    num_blocks = max(SIZES_BLOCKS)
    hashes = chain_hashes(num_blocks)
    results = []
    shared = SharedKVAllocator() if backend == SHARED_MEMORY else None
    engine_backend = "zmq" if shared is not None else backend
    kv = shared.allocate((num_blocks, BLOCK_ELEMS), torch.float32) if shared else torch.zeros((num_blocks, BLOCK_ELEMS))
    pool = BlockPool(num_blocks)
    auth = ClusterAuth(token)
    agent = TransferAgent("bench-requester", pool, kv, create_transfer_engine(engine_backend, auth=auth),
                          StaticPeers(), auth, shared_region=shared and shared.region,
                          num_landing_slots=num_blocks,  # one round for every size of the sweep
                          landing_chunk_bytes=landing_chunk_bytes).start()
    chunk_bytes = agent.requester.landing_chunk_blocks * BLOCK_BYTES if agent.landing is not None else None
    transport = SHARED_MEMORY if shared is not None else agent.engine.transport
    piece_bytes = 0 if shared is not None else agent.engine.max_descriptor_bytes
    try:
        for layout in ("contiguous", "scattered"):
            proc, peer = _holder(engine_backend, num_blocks, layout == "contiguous", agent, token)
            try:
                _push(agent, peer, [0], hashes[:1], timeout_s=60)  # warm-up: connections, handshakes
                for n in SIZES_BLOCKS:
                    dst = list(range(n)) if layout == "contiguous" else list(range(0, num_blocks, 2))[:n]
                    if len(dst) < n:  # not enough even ids: interleave from the end
                        dst += list(range(num_blocks - 1, 0, -2))[: n - len(dst)]
                    times, num_short = [], 0
                    short_until = time.monotonic() + SHORT_PUSHES_FOR_S
                    landed_before = agent.landing.land_s if agent.landing is not None else 0.0
                    while len(times) < repeat + 1:
                        start = time.perf_counter()
                        num_written = _push(agent, peer, dst, hashes[:n], timeout_s=120)
                        if num_written < n:  # landing slots that did not check out in time (a loaded machine)
                            num_short += 1
                            if time.monotonic() > short_until:
                                raise RuntimeError(f"pushes of {n} blocks kept coming back short for "
                                                   f"{SHORT_PUSHES_FOR_S:.0f} s ({num_short} of them)")
                            time.sleep(0.05)
                            continue  # timed: whole pushes only
                        times.append(time.perf_counter() - start)
                    seconds = statistics.median(times[1:])
                    fence_s = ((agent.landing.land_s - landed_before) / (len(times) + num_short)
                               if agent.landing is not None else 0.0)  # per push, the short ones included
                    wire_s = _wire_seconds(proc, n, repeat, agent.node_id)
                    results.append({"backend": backend, "transport": transport, "layout": layout,
                                    "fence_s": fence_s, "fence_share": fence_s / seconds, "wire_s": wire_s,
                                    "wire_gib_per_s": n * BLOCK_BYTES / wire_s / GIB if wire_s else None,
                                    "of_wire": wire_s / seconds if wire_s else None,
                                    "size_bytes": n * BLOCK_BYTES, "num_blocks": n,
                                    "descriptors": len(to_descriptors(coalesce(dst, dst), 0, 0, BLOCK_BYTES,
                                                                      piece_bytes)),
                                    "seconds": seconds, "gib_per_s": n * BLOCK_BYTES / seconds / GIB,
                                    "num_short_pushes": num_short, "landing_chunk_bytes": chunk_bytes})
                    bar.update(1)
            finally:
                proc.stdin.write("quit\n")
                proc.stdin.flush()
                proc.wait(timeout=30)
    finally:
        agent.close()
        if shared is not None:
            shared.close()
    return results


def run(json_path: str | None, backends: list[str] | None = None, repeat: int = 3, insecure: bool = False,
        landing_chunk_bytes: int = -1) -> dict:
    """``insecure``: no cluster token (plain ZMQ frames with a public MAC key): the baseline of CurveZMQ's cost.
    ``landing_chunk_bytes``: the requester's chunks of pushes into landing slots (-1: a node's default here)."""
    backends = backends or ((["mooncake"] if mooncake_available() else []) + ["zmq", SHARED_MEMORY])
    res = {"machine": machine(), "channel_security": not insecure, "block_bytes": BLOCK_BYTES, "memcpy_gib_per_s": memcpy_gib_per_s(),
           "socket_gib_per_s": socket_gib_per_s(), "check_path": check_path_gib_per_s(), "results": []}
    threads = min(4, os.cpu_count() or 1)  # what a node's landing splits a long receive among (transfer/kv_agent.py)
    rate = res["check_path"]["copy_and_crc32_gib_per_s"]
    # Projections from the measured per-core rate: the link the fence keeps up with on a node's checksum threads,
    # and the fence's CPU time per second of a 100 Gbit/s wire (cores busy copying and checking while it runs).
    res["check_path"].update(threads=threads, projection_fence_limit_gib_per_s=threads * rate,
                             projection_fence_core_s_per_wire_s_at_100gbit=LINK_100GBIT_GIB_PER_S / rate)
    with tqdm(total=len(backends) * 2 * len(SIZES_BLOCKS), desc="transfer sweep", leave=False) as bar:
        for backend in backends:
            res["results"] += bench_backend(backend, repeat, bar, "" if insecure else _TOKEN, landing_chunk_bytes)
    ceiling = res["socket_gib_per_s"]
    rows = [[r["backend"], r["transport"], r["layout"], f"{r['size_bytes'] / 2**20:g} MiB", r["descriptors"],
             f"{r['gib_per_s']:.2f}", f"{r['gib_per_s'] / ceiling:.2f}",
             f"{r['wire_gib_per_s']:.2f}" if r["wire_s"] else "-", f"{r['of_wire']:.2f}" if r["wire_s"] else "-",
             f"{r['fence_s'] * 1e3:.1f} ms ({r['fence_share']:.0%})" if r["fence_s"] else "-"] for r in res["results"]]
    check = res["check_path"]
    print(f"\nceilings: memcpy {res['memcpy_gib_per_s']:.2f} GiB/s, TCP socket {ceiling:.2f} GiB/s; landing check "
          f"path on one core: crc32 {check['crc32_gib_per_s']:.2f} GiB/s (zlib's {check['zlib_crc32_gib_per_s']:.2f}), "
          f"copy + crc32 "
          f"{check['copy_and_crc32_gib_per_s']:.2f} GiB/s (projection: the fence limits a link at "
          f"{check['projection_fence_limit_gib_per_s']:.1f} GiB/s on {check['threads']} threads; at 100 Gbit/s it "
          f"keeps {check['projection_fence_core_s_per_wire_s_at_100gbit']:.1f} cores busy while the wire runs)")
    print_table("KV push between two processes (end to end)",
                ["backend", "transport", "layout", "size", "descriptors", "GiB/s", "of socket", "wire alone GiB/s",
                 "of wire", "fence (copy + check)"],
                rows)
    write_json(json_path, res)
    return res
