"""SelfDraftProposer: the target model's first layers, its final norm and head, as the draft model.

No second model to load or keep in memory, and no second KV cache: the draft's layers are the
target's, so the K/V it needs for earlier tokens are already in the target's paged buffer.
Drafting token by token writes K/V of its layers at positions past the sequence's computed
length, in the sequence's own uncached blocks; the verification forward that follows writes
every layer at those positions again, so nothing the draft wrote outlives the step.

    positions   ... num_computed-1 | num_computed (last token) | +1 .. +k (guesses)
    K/V         all layers, cached | draft layers, then all    | draft layers, then all (verify)
"""
from __future__ import annotations

import torch

from kvmesh.engine.sampler import target_probs
from kvmesh.engine.sequence import Sequence
from kvmesh.engine.spec_decode.proposers import Proposal
from kvmesh.kernels.attention_metadata import AttentionMetadata
from kvmesh.model.llama import LlamaForCausalLM


class SelfDraftProposer:
    def __init__(self, model: LlamaForCausalLM, kv_buffer: torch.Tensor, block_size: int, num_layers: int = 0):
        total = model.config.num_layers
        self.num_layers = num_layers or max(1, total // 4)
        if not 1 <= self.num_layers < total:
            raise ValueError(f"a self-draft runs 1..{total - 1} of the target's {total} layers, not {num_layers}")
        self.model = model
        self.kv_buffer = kv_buffer
        self.block_size = block_size

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_tokens: int) -> Proposal:
        """Greedy guesses for greedy requests; sampled ones (with their distributions) otherwise.

        ``seq``'s blocks must already cover ``num_computed_tokens + 1 + max_tokens`` positions.
        """
        position = seq.num_computed_tokens
        token = seq.token_at(position)
        device = self.kv_buffer.device
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(max_tokens):
            md = AttentionMetadata.build(query_lens=[1], seq_lens=[position + 1], block_tables=[seq.block_ids],
                                         block_size=self.block_size, device=device)
            hidden = self.model(torch.tensor([token], device=device), torch.tensor([position], device=device),
                                self.kv_buffer, md, num_layers=self.num_layers)
            logits = self.model.compute_logits(hidden)[0]
            if seq.params.greedy:
                token = int(logits.argmax())
            else:
                q = target_probs(logits.float().cpu(), seq.params)  # the request's generator is a CPU one
                q = q / q.sum()
                token = int(torch.multinomial(q, 1, generator=seq.generator).item())
                probs.append(q)
            tokens.append(token)
            position += 1
        return Proposal(tokens, torch.stack(probs) if probs else None)
