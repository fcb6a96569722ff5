"""Sampler: logits of the rows that need a token -> token ids and their logprobs."""
from __future__ import annotations

import torch

from kvmesh.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """logits [B, V] float32; row i follows ``params[i]`` and draws from ``generators[i]``.

    Greedy rows take the argmax (ties: lowest id). Others apply temperature, then
    top-k, then top-p (smallest set whose probability reaches top_p), then draw.
    The logprob returned is that of the chosen token under the unmodified model; rows whose
    params ask for ``logprobs=k`` also get the k most likely tokens with theirs (else []).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scaled = logits[row] / p.temperature
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs
            sorted_probs[before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token_ids[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())
    logprobs = [float(logprobs_all[row, tok]) for row, tok in enumerate(token_ids)]
    tops: list[list[tuple[int, float]]] = []
    for row, p in enumerate(params):
        if p.logprobs:
            values, ids = torch.topk(logprobs_all[row], p.logprobs)
            tops.append(list(zip(ids.tolist(), values.tolist())))
        else:
            tops.append([])
    return token_ids, logprobs, tops
