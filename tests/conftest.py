"""Shared fixtures. Triton runs in its interpreter on machines without CUDA.

The suite depends on nothing a machine's past left in ``$HOME``: it runs with a ``HOME`` of its own (a
temporary folder, removed at exit; every process a test starts inherits it), and its caches of compiled
kernels and converted models live in the clone (``.kvmesh-cache``) unless ``KVMESH_CACHE_DIR`` says otherwise.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("KVMESH_CACHE_DIR", str(REPO / ".kvmesh-cache"))  # before HOME moves: built once per clone
SUITE_HOME = tempfile.mkdtemp(prefix="kvmesh-test-home-")
atexit.register(shutil.rmtree, SUITE_HOME, True)
os.environ["HOME"] = SUITE_HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(SUITE_HOME, ".cache")
for _name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
    os.environ.pop(_name, None)  # the caller's Ray settings are not the suite's
# The suite runs several torch processes per core (two workers, each with node processes): OpenMP threads that
# spin after every parallel region (libgomp's default) take those cores from the others. Every process the
# suite starts inherits this; it must precede the first torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

pytest_plugins = ["tests.router_support"]  # the router files' running cluster (``served``, ``reference``)

from kvmesh.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kvmesh.kv.kv_buffer import KVLayout  # noqa: E402
from kvmesh.model.loader import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def ray_auth_env() -> dict[str, str]:
    """The environment of a process joining the suite's Ray clusters: token authentication on, with a token
    the suite made itself (Ray 2.60 checks for a token but never creates one for ``ray start``)."""
    path = Path(SUITE_HOME) / "ray_auth_token"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return load_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3() -> LoadedModel:
    return load_model("tiny-qwen3")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf():
    """Hugging Face's own load of the same GGUF: the independent reference."""
    from transformers import AutoModelForCausalLM

    from kvmesh.model.presets import PRESETS

    path = PRESETS["smollm2-135m"].gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_reference(loaded: LoadedModel):
    """A transformers model with kvmesh's weights, built from kvmesh's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvmesh.model.config import to_hf_dict

    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_dict(loaded.config)), dtype=torch.float32)
    hf.load_state_dict(loaded.model.hf_state_dict(), strict=True)
    return hf.eval()


def run_prefill(loaded: LoadedModel, token_ids: list[int], block_size: int = 16,
                kv: torch.Tensor | None = None, block_ids: list[int] | None = None,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Prefill ``token_ids`` at positions ``start..`` into ``kv``; returns (logits of every new token, kv, block ids)."""
    total = start + len(token_ids)
    num_blocks = -(-total // block_size)
    if kv is None:  # room for at least 320 tokens, so a later chunk can extend this sequence
        capacity = max(num_blocks, -(-320 // block_size))
        layout = KVLayout.for_model(loaded.config, loaded.dtype, block_size, num_blocks=capacity + 3)
        kv = layout.allocate(loaded.device)
        # Deliberately scattered, non-monotonic block ids.
        block_ids = list(range(capacity + 2, 2, -1))
    md = AttentionMetadata.build(query_lens=[len(token_ids)], seq_lens=[total],
                                 block_tables=[block_ids[:num_blocks]], block_size=block_size,
                                 device=loaded.device)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(token_ids, device=loaded.device),
                              torch.arange(start, total, device=loaded.device), kv, md)
        logits = loaded.model.compute_logits(hidden)
    return logits, kv, block_ids


def assert_same_kv(client, reference_llm, token_ids: list[int], min_blocks: int) -> None:
    """The KV-level oracle: a node's cached KV of ``token_ids`` (read through its block table, a debug call)
    equals the single-node reference ``LLM``'s position by position, over at least ``min_blocks`` blocks
    (``kvmesh/engine/kv_probe.py`` ``compare_with_engine``, what the benchmarks use too)."""
    from kvmesh.engine.kv_probe import compare_with_engine

    got = client.stats(kv_probe=list(token_ids))["kv_probe"]
    compared, mismatched = compare_with_engine(reference_llm, [(list(token_ids), got)])
    assert compared >= min_blocks, (got["num_blocks"], compared)
    assert mismatched == []


def pytest_terminal_summary(terminalreporter, config) -> None:
    """A shuffled run (``make test ORDER=``) says how to replay its order, even under ``-q``."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order shuffled: replay it with make test ORDER=--randomly-seed={seed}")
