"""LLM: the offline API vLLM users know.

    from kvmesh import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm import tqdm

from kvmesh.engine.engine import EngineConfig, LLMEngine
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import SchedulerConfig
from kvmesh.engine.spec_decode.speculator import SpeculativeConfig
from kvmesh.model.loader import load_model


class LLM:
    def __init__(self, model: str = "tiny-llama", *, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory_gib: float = 0.5,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                 max_num_partial_prefills: int = 4, eviction_policy: str = "tail-first-lru",
                 speculative: SpeculativeConfig | None = None, progress: bool = True, enforce_eager: bool = False,
                 load_format: str = "auto", tensor_parallel_size: int = 1):
        """``enforce_eager``: on CUDA, no CUDA graphs of decode or prompt steps (``kvmesh/engine/cuda_graphs.py``).
        ``load_format="dummy"``: seeded weights of the model's shape, made on the device (``model/dummy_weights.py``).
        ``tensor_parallel_size`` N > 1: the model split over N ranks, this process and N - 1 it starts
        (``kvmesh/parallel/ranks.py``; on the CPU they split the cores, this process's torch threads included, until
        ``close``); ``close`` stops them (so does exit).
        ``kv_cache_memory_gib`` is then each rank's."""
        self.ranks = None
        if tensor_parallel_size > 1:
            from kvmesh.parallel.ranks import TensorParallelRanks

            self.ranks = TensorParallelRanks(model, tensor_parallel_size, dtype=dtype, device=device,
                                             load_format=load_format, progress=progress)
            self.loaded = self.ranks.loaded
        else:
            self.loaded = load_model(model, dtype=dtype, device=device, progress=progress, load_format=load_format,
                                     tp=(0, tensor_parallel_size, None))
        scheduler = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                    long_prefill_token_threshold=long_prefill_token_threshold,
                                    max_num_partial_prefills=max_num_partial_prefills)
        self.engine = LLMEngine(self.loaded, EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory_gib=kv_cache_memory_gib,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, speculative=speculative,
            eviction_policy=eviction_policy, scheduler=scheduler, enforce_eager=enforce_eager))

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any (the engine cannot step afterwards)."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        Every request is validated before any runs: one bad prompt raises and runs nothing.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        seqs = [self.engine.prepare_request(p, sp) for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            self.engine.scheduler.add(seq)
        with tqdm(total=len(seqs), desc="generating", disable=not use_tqdm, leave=False) as bar:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        return [self.engine.to_output(seq) for seq in seqs]
