"""KV fingerprints of a cached prompt, read through the block table: the KV-level oracle of the tests.

Greedy tokens do not see every wrong KV: blocks received into the wrong slots of a block table
can leave outputs unchanged (positions are baked into the keys). A fingerprint compares the KV
itself, position by position: for every position of the prompt's cached full blocks, in chain
order, the sum of each KV head's key and of its value in each layer (per head: heads in the wrong
places, a tensor-parallel layout gone wrong, are seen too). Nodes answer it as a debug
call (``StatsRequest.kv_probe``); a single-node engine on the same weights gives the reference.
"""
from __future__ import annotations

import torch


def prompt_kv_sums(engine, token_ids: list[int]) -> dict:
    """{"num_blocks": the prompt's full blocks cached here, in chain order, "sums": [position][layer][k, v][head]
    flattened}. Call on the engine's thread (or with the engine idle)."""
    hashes = engine.kv.hash_prompt(list(token_ids))
    block_ids = engine.pool.match(hashes)
    if not block_ids:
        return {"num_blocks": 0, "sums": []}
    kv = engine.runner.kv_buffer[torch.tensor(block_ids, device=engine.runner.kv_buffer.device)].float()
    # [blocks, layers, 2, block_size, kv_heads, head_dim] -> [blocks * block_size, layers, 2, kv_heads]
    sums = kv.sum(dim=-1).permute(0, 3, 1, 2, 4).reshape(-1, kv.shape[1], 2, kv.shape[4])
    return {"num_blocks": len(block_ids), "sums": sums.flatten().cpu().tolist()}


def mismatched_positions(got: dict, want: dict, num_layers: int, num_kv_heads: int, rtol: float = 1e-3,
                         atol: float = 1e-3) -> list[int]:
    """Positions (of the blocks both hold) whose per-layer K/V sums differ beyond the tolerance."""
    n = min(got["num_blocks"], want["num_blocks"])
    if n == 0:
        return []
    a = torch.tensor(got["sums"]).view(-1, num_layers, 2, num_kv_heads)
    b = torch.tensor(want["sums"]).view(-1, num_layers, 2, num_kv_heads)
    positions = n * a.shape[0] // got["num_blocks"]
    bad = ~torch.isclose(a[:positions], b[:positions], rtol=rtol, atol=atol)
    return bad.any(dim=(1, 2, 3)).nonzero().flatten().tolist()


def compare_with_engine(llm, probes: list[tuple[list[int], dict]]) -> tuple[int, list[tuple[int, list[int]]]]:
    """Node fingerprints (prompt, ``StatsRequest.kv_probe`` answer) against ``llm``'s own KV of the same prompts.

    A prompt ``llm`` no longer caches is prefilled again first. Returns (blocks compared, [(index into
    ``probes``, the first mismatched positions)]).
    """
    from kvmesh.engine.sampling_params import SamplingParams

    num_layers, num_kv_heads = llm.loaded.config.num_layers, llm.loaded.config.num_kv_heads
    compared, mismatched = 0, []
    for i, (token_ids, got) in enumerate(probes):
        want = prompt_kv_sums(llm.engine, token_ids)
        if want["num_blocks"] < got["num_blocks"]:
            llm.generate([list(token_ids)], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            want = prompt_kv_sums(llm.engine, token_ids)
        compared += min(got["num_blocks"], want["num_blocks"])
        bad = mismatched_positions(got, want, num_layers, num_kv_heads)
        if bad:
            mismatched.append((i, bad[:8]))
    return compared, mismatched
