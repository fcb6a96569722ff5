"""Work every process would repeat runs once: the lock itself, and a GGUF converted into the cache once when
several loads start together (each then reads the one copy)."""
from __future__ import annotations

import threading

import torch

from kvmesh.file_lock import exclusive


def test_a_held_lock_keeps_another_holder_out_until_it_is_released(tmp_path):
    lock = tmp_path / "sub" / ".work.lock"
    entered = threading.Event()

    def second() -> None:
        with exclusive(lock):
            entered.set()

    with exclusive(lock):
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.3), "a second holder got in while the lock was held"
    assert entered.wait(30)
    thread.join()


def test_loads_starting_together_convert_a_gguf_once(tmp_path, monkeypatch):
    from kvmesh.model import gguf_loader
    from kvmesh.model.presets import PRESETS

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read: the conversion is replaced")
    config = PRESETS["tiny-llama"].config
    conversions = []
    both = threading.Barrier(2)

    def convert(path, progress=True):
        conversions.append(path)
        try:
            both.wait(timeout=1.0)  # without the lock two conversions meet here
        except threading.BrokenBarrierError:
            pass
        return config, {"w": torch.arange(4.0)}

    monkeypatch.setattr(gguf_loader, "load_gguf", convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_loader.load_gguf_cached(gguf, progress=False)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1, "each load converted the GGUF itself"
    assert len(results) == 2 and all(torch.equal(state["w"], torch.arange(4.0)) for _, state in results)
