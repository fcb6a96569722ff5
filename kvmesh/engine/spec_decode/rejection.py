"""Verification of drafted tokens against the target model (speculative decoding).

One forward of the target over ``[last token, d1 .. dk]`` gives k+1 rows of logits:
row i is the target's next-token distribution after ``d1 .. di``. Drafts are accepted
left to right:

    greedy       d(i+1) is kept while it equals the argmax of row i
    sampling     d(i+1) is kept with probability min(1, p_i(d) / q_i(d)), where p_i is the
                 target's distribution (temperature, top-k, top-p applied) and q_i the draft's
                 (a point mass on d for drafts that are not sampled, e.g. prompt lookup)

At the first rejection one token is drawn from the residual max(0, p_i - q_i), normalised,
and the rest of the draft is dropped; when every draft is kept, one more token is drawn
from row k. Either way a step emits between 1 and k+1 tokens, and the emitted sequence is
distributed exactly as plain sampling from the target would be (Leviathan et al., 2023).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvmesh.engine.sampler import target_probs
from kvmesh.engine.sampling_params import SamplingParams


class Verdict(NamedTuple):
    token_ids: list[int]  # the accepted drafts, then one token from the target
    num_accepted: int  # how many drafts were kept (len(token_ids) - 1)


def verify_drafts(logits: torch.Tensor, draft_ids: list[int], params: SamplingParams,
                  generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> Verdict:
    """``logits`` [k+1, V] (float32) of the target; ``draft_probs`` [k, V], the draft's distributions, or
    None when the drafts were not sampled (a point mass on each draft token)."""
    k = len(draft_ids)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of logits, got {logits.shape[0]}")
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        num = 0
        while num < k and draft_ids[num] == best[num]:
            num += 1
        return Verdict(draft_ids[:num] + [best[num]], num)
    for i, d in enumerate(draft_ids):
        p = _normalised(target_probs(logits[i], params))
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and float(torch.rand((), generator=generator)) * q_d < float(p[d]):  # u < p(d) / q(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is measure-zero; fall back to p
            residual = p
        token = int(torch.multinomial(residual, 1, generator=generator).item())
        return Verdict(draft_ids[:i] + [token], i)
    bonus = int(torch.multinomial(target_probs(logits[k], params), 1, generator=generator).item())
    return Verdict(list(draft_ids) + [bonus], k)


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum()
