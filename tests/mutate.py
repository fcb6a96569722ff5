"""``make mutate``: deliberate breakages, each of which some test must catch.

Each mutation replaces one snippet of the implementation, runs the tests that name what it breaks,
and expects one of them to fail on an assertion; the file is restored afterwards whatever happens.
A breakage counts as caught only when the same tests pass on the clean tree first and a test then
fails in its body on an assertion (``assert``, ``pytest.raises``/``pytest.fail``): not on a collection
or fixture error, an exception of another kind, or a timeout. Prints a table and exits non-zero when a
breakage went unnoticed. It edits the working tree while it runs: run nothing else from this checkout
meanwhile.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvmesh.cpu_info import cpu_flags  # noqa: E402  (torch-free)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the breakage
    # CPU flags without which the mutated code never runs here, space-separated; "!flag": only without it
    # (else: not applicable)
    requires: str = ""


MUTATIONS = (
    Mutation("a step computes prompt tokens past the prompt budget of a fetch about to land",
             "kvmesh/engine/scheduler.py",
             "        prompt_room = budget if cap is None else min(budget, cap)",
             "        prompt_room = budget",
             ("tests/test_landing_bound.py",)),
    Mutation("an all-greedy batch on the host picks token 0 in every row",
             "kvmesh/engine/sampler.py", "        picked = np.where(finite, logits.numpy().argmax(axis=-1), 0)\n",
             "        picked = np.zeros(len(params), dtype=np.int64)\n", ("tests/test_sampling.py",)),
    Mutation("the native greedy pick lets a row with a NaN or an infinity through",
             "kernels/cpu/greedy_pick.c", "    if (flag != 0.0f || n == 0) {", "    if (n == 0) {",
             ("tests/test_cpu_kernels.py::test_native_greedy_pick_is_each_rows_first_maximum_and_its_logprob",)),
    Mutation("the native greedy pick's logprob leaves out the row's tail past its last whole lane group",
             "kernels/cpu/greedy_pick.c", "    for (int64_t t = full; t < n; t++) sum += exp_clamped(x[t] - max);\n",
             "", ("tests/test_cpu_kernels.py::test_native_greedy_pick_is_each_rows_first_maximum_and_its_logprob",)),
    Mutation("a decode whose new token starts a block is scheduled without allocating that block",
             "kvmesh/engine/scheduler.py", "if seq.num_computed_tokens // block_size < len(seq.block_ids) or",
             "if seq.num_computed_tokens // block_size <= len(seq.block_ids) or",
             ("tests/test_priorities.py::test_every_scheduled_token_has_a_block_as_decodes_cross_block_ends",)),
    Mutation("a decode-only step feeds each row the token before its last",
             "kvmesh/engine/model_runner.py",
             "StepInputs(list(range(len(batch))), [seq.token_at(p) for (seq, _), p in zip(batch, positions)]",
             "StepInputs(list(range(len(batch))), [seq.token_at(p - 1) for (seq, _), p in zip(batch, positions)]",
             ("tests/test_engine.py",)),
    Mutation("a CUDA graph is captured with the cuBLAS workspace of the warm-ups (not its own)",
             "kvmesh/engine/cuda_graphs.py",
             "        self.graph = torch.cuda.CUDAGraph()\n        release_cublas_workspaces()\n",
             "        self.graph = torch.cuda.CUDAGraph()\n",
             ("tests/test_cuda_graphs.py",)),
    Mutation("the automatic prompt slice caps each prompt, not the step beside running decodes",
             "kvmesh/node/landing_bound.py",
             "        cap = (self.step_tokens or None) if num_decodes else None",
             "        cap = None", ("tests/test_landing_bound.py", "-k", "whole_step")),
    Mutation("the step cap keeps the rate it was set at", "kvmesh/node/landing_bound.py",
             "        return prompt_slice(self._tokens_per_s(), self.block_size, self._step_budget, self._step_slice_s)",
             "        return prompt_slice(640.0, self.block_size, self._step_budget, self._step_slice_s)",
             ("tests/test_landing_bound.py", "-k", "whole_step")),
    Mutation("start-up probes of nodes sharing the cores run at once", "kvmesh/node/core_share.py",
             "                fcntl.flock(fd, fcntl.LOCK_EX)", "                pass",
             ("tests/test_core_share.py", "-k", "take_turns")),
    Mutation("the tier demoter polls instead of sleeping until the free queue moves", "kvmesh/kv/tiers/tiered_cache.py",
             "                moved_event.wait(self.cfg.idle_look_s)", "                self._stop.wait(0.01)",
             ("tests/test_tiers.py", "-k", "sleeps")),
    Mutation("freeing blocks into the pool's queue does not wake the demoter", "kvmesh/kv/block_pool.py",
             "                    self._append(b)\n            if self._num_queued != queued:\n"
             "                self._mark_queue_moved()\n\n    def touch",
             "                    self._append(b)\n\n    def touch",
             ("tests/test_block_pool.py", "-k", "queue_moved")),
    Mutation("a prompt spread over capped steps is priced at its compute alone", "kvmesh/node/planner.py",
             "        return tokens / req.local_tokens_per_s + more_steps * req.local_decode_step_s",
             "        return tokens / req.local_tokens_per_s", ("tests/test_planner.py", "-k", "spread")),
    Mutation("the streams' wait counts the decode steps they run in", "kvmesh/node/planner.py",
             "        return req.num_streams * tokens / req.local_tokens_per_s",
             "        return req.num_streams * compute_here(tokens)", ("tests/test_planner.py", "-k", "spread")),
    Mutation("a prompt that fits one capped step pays a decode step more", "kvmesh/node/planner.py",
             "        more_steps = max(0, -(-tokens // req.local_step_tokens) - 1) if spreads else 0",
             "        more_steps = -(-tokens // req.local_step_tokens) if spreads else 0",
             ("tests/test_planner.py", "-k", "spread")),
    Mutation("the landing bound never lets a stalled fetch go", "kvmesh/node/landing_bound.py",
             "        due = [landing for landing, until in self._due.values() if now <= until]",
             "        due = [landing for landing, until in self._due.values()]",
             ("tests/test_landing_bound.py",)),
    Mutation("a drain drops the streams it hands back (their callers never hear)", "decode_node/worker.py",
             "            self.node.send_event(request.identity, nm.TokenEvent(rid, [], finished=True, "
             "finish_reason=\"error\",",
             "            self.node.send_event(b\"nobody\", nm.TokenEvent(rid, [], finished=True, "
             "finish_reason=\"error\",",
             ("tests/test_role_change.py", "-k", "streams_continue_elsewhere and zmq")),
    Mutation("the role balancer moves on a single tick's verdict (no hysteresis)", "cluster/role_balancer.py",
             "        if not verdict or self._streak[1] < cfg.sustain or now - self._last_move_at < cfg.cooldown_s:",
             "        if not verdict:",
             ("tests/test_role_balancer.py",)),
    Mutation("the role balancer lets the last prefill node leave on a decode pressure near its SLO",
             "cluster/role_balancer.py", "        if verdict == \"decode\" and num_prefill == 1 and decode < 1.0:",
             "        if verdict == \"decode\" and num_prefill == 1 and decode < cfg.high:", ("tests/test_role_balancer.py",)),
    Mutation("an all-decode cluster waits for its decode pressure to fall before moving a node to prefill",
             "cluster/role_balancer.py", "(decode <= cfg.low or num_prefill == 0)", "(decode <= cfg.low)",
             ("tests/test_role_balancer.py",)),
    Mutation("the pool's count of cached free blocks misses blocks leaving the free queue", "kvmesh/kv/block_pool.py",
             "        self._num_cached_queued -= self._slot[block] >= 0\n", "\n", ("tests/test_block_pool.py",)),
    Mutation("the sampler reads each host row's logprob at token 0", "kvmesh/engine/sampler.py",
             "logprobs_all.numpy()[np.arange(len(picked)), picked]", "logprobs_all.numpy()[np.arange(len(picked)), 0]",
             ("tests/test_sampling.py",)),
    Mutation("a change as the pool's owner runs on the calling thread while the engine loop runs",
             "kvmesh/node/engine_loop.py",
             "        if self._thread.is_alive() and threading.current_thread() is not self._thread:",
             "        if False:", ("tests/test_engine_loop.py",)),
    Mutation("the engine tells its hooks of tokens sampled inside unobserved", "kvmesh/engine/engine.py",
             "        on_token = self.hooks.on_token if self._observed else None\n",
             "        on_token = self.hooks.on_token\n", ("tests/test_engine.py",)),
    Mutation("the GPU checksum kernel combines its lanes in the wrong order", "kernels/triton/block_crc32.py",
             "    shifts.reverse()  # lane l", "    # shifts.reverse()  # lane l", ("tests/test_fast_crc.py",)),
    Mutation("a landing onto a GPU's KV buffer skips the check after the copy", "transfer/landing.py",
             "            good = leading_equal(self._check_blocks(list(block_ids)), checksums)",
             "            good = len(slots)", ("tests/test_landing.py",)),
    Mutation("a holder writes a landing push in one piece whatever chunks the requester asked for",
             "transfer/holder.py", "            push.chunk_blocks = msg.chunk_blocks",
             "            push.chunk_blocks = 0",
             ("tests/test_transfer.py::test_a_push_into_landing_slots_is_received_in_chunks_each_checked_while_the_"
              "next_is_written",)),
    Mutation("a scale-down removes a decode node still draining its streams", "cluster/role_controller.py",
             '            if roles.get(node_id) == "prefill":\n                self.supply.remove_node(node_id)',
             '            if roles.get(node_id) is not None:\n                self.supply.remove_node(node_id)',
             ("tests/test_scale_policy.py",)),
    Mutation("the scale policy acts on a single tick's verdict (no hysteresis)", "cluster/scale_policy.py",
             '        needed = cfg.sustain_down if verdict == "remove" else cfg.sustain',
             "        needed = 1", ("tests/test_scale_policy.py",)),
    Mutation("the role balancer reads each prompt's own tail as prefill nodes falling behind",
             "cluster/role_balancer.py", "            computed += max(0, (now[0] - before[0]) - (now[2] - before[2]))",
             "            computed += now[0] - before[0]", ("tests/test_role_balancer.py",)),
    Mutation("the pool calls its uncache hook under its lock", "kvmesh/kv/block_pool.py",
             "                self._uncached.append((h, parent_hashes[16 * i : 16 * i + 16] if parent != NO_BLOCK else None))",
             "                self.on_uncache(h, parent_hashes[16 * i : 16 * i + 16] if parent != NO_BLOCK else None)",
             ("tests/test_block_pool.py",)),
    Mutation("the folded crc32 uses a wrong folding constant", "kvmesh/kv/crc32.c",
             "_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL)", "_mm_set_epi64x(0x1c6e41596LL, 0x154442bd5LL)",
             ("tests/test_fast_crc.py",), requires="pclmulqdq"),
    Mutation("a push sends a stored checksum from before its block was allocated again", "kvmesh/kv/block_checksums.py",
             "            out = [self._value[b] if self._epoch[b] == e else None for b, e in zip(block_ids, epochs)]",
             "            out = [self._value[b] if self._epoch[b] >= 0 else None for b, e in zip(block_ids, epochs)]",
             ("tests/test_block_pool.py", "-k", "stored_checksums")),
    Mutation("a landing copy into a host KV buffer skips the check of what arrived", "transfer/landing.py",
             "            good = leading_equal(self._copy_and_check(list(zip(slots, block_ids))), checksums)",
             "            good = len(self._copy_and_check(list(zip(slots, block_ids))))",
             ("tests/test_transfer.py", "-k", "computed_once and mooncake")),
    Mutation("a receive over zmq skips the check of what arrived", "transfer/requester.py",
             "                        num = self.verify(block_ids[:num], msg.checksums[:num])",
             "                        num = num",
             ("tests/test_transfer.py", "-k", "computed_once")),
    Mutation("mixture of experts: top-k routing weights are not renormalised", "kvmesh/model/moe.py",
             "    if normalize:\n",
             "    if False:\n",
             ("tests/test_moe.py", "-k", "transformers_does")),
    Mutation("mixture of experts: the Triton kernel's tiles are not padded to whole experts", "kernels/triton/moe.py",
             "    padded = (counts + block_m - 1) // block_m * block_m",
             "    padded = counts",
             ("tests/test_kernels.py", "-k", "moe")),
    Mutation("mixture of experts: tensor-parallel ranks take rows across the gate and up halves",
             "kvmesh/model/tp_shard.py",
             "            return torch.cat([gate.narrow(1, self.rank * per, per), up.narrow(1, self.rank * per, per)], dim=1)",
             "            return tensor.narrow(1, self.rank * 2 * per, 2 * per)",
             ("tests/test_tensor_parallel.py", "-k", "one_rank_streams and moe")),
    Mutation("tensor parallelism: the MLP's partial sums are never all-reduced", "kvmesh/model/layers.py",
             "        return out if self.group is None else self.group.all_reduce(out)",
             "        return out",
             ("tests/test_tensor_parallel.py", "-k", "one_rank_streams")),
    Mutation("tensor parallelism: a rank takes another rank's KV heads", "kvmesh/model/tp_shard.py",
             "            first = self.kv_head_ids[0]",
             "            first = 0",
             ("tests/test_tensor_parallel.py", "-k", "one_rank_streams")),
    Mutation("tensor parallelism: a rank reads and writes another rank's heads of the shared KV buffer",
             "kvmesh/parallel/rank_main.py",
             '    heads = head_slice(loaded.config, init["rank"], init["size"])',
             '    heads = head_slice(loaded.config, 0, init["size"])',
             ("tests/test_tensor_parallel.py", "-k", "one_rank_streams")),
    Mutation("tensor parallelism: a node keeps its ranks' heads in swapped places (right for itself alone, wrong "
             "for every peer of another size)", "kvmesh/parallel/ranks.py",
             "    ids = TPShard(config, rank, size).kv_head_ids",
             "    ids = TPShard(config, size - 1 - rank, size).kv_head_ids",
             ("tests/test_tensor_parallel_cluster.py", "-k", "zmq")),
    Mutation("aborts are dropped on their way to the node", "cluster/node_connection.py",
             "        self._send(encode(nm.AbortRequest(request_id)))",
             "        pass  # mutation: the abort never leaves",
             ("tests/test_router.py", "-k", "goes_away or stop_strings")),
    Mutation("received blocks land in reversed slots", "kvmesh/node/connectors.py",
             "            pushed = self._requester.push(node_id, list(lease.block_ids[start:length]),",
             "            pushed = self._requester.push(node_id, list(lease.block_ids[start:length])[::-1],",
             ("tests/test_cluster.py", "-k", "cross_node")),
    Mutation("stop strings searched only in each token's new text", "kvmesh/engine/stop_strings.py",
             '        self._tail = window[-self._keep:] if self._keep else ""',
             '        self._tail = ""  # mutation: a stop string spanning two settlings is missed',
             ("tests/test_stop_strings.py",)),
    Mutation("the router's typed view of a node carries none of its counters", "kvmesh/node/runtime.py",
             '        load = nm.NodeLoadStats.from_stats({"role": self.role_name, **stats})',
             '        load = nm.NodeLoadStats.from_stats({"role": self.role_name})',
             ("tests/test_cluster.py", "-k", "typed_record and zmq")),
    Mutation("blocks a stalled writer may still write stay in the request", "kvmesh/engine/kv_connector.py",
             "                kv.replace_blocks(seq, report.tainted)",
             "                pass  # mutation: the late writer's blocks are read",
             ("tests/test_kv_connector.py",)),
    Mutation("a load's report counts blocks that never arrived", "kvmesh/engine/kv_connector.py",
             "        self._scheduler.remote_kv_ready(seq.request_id, report.got * self._scheduler.kv.block_size)",
             "        self._scheduler.remote_kv_ready(seq.request_id, lease.end * self._scheduler.kv.block_size)",
             ("tests/test_kv_connector.py",)),
    Mutation("a prefill node's blocks land in reversed slots", "decode_node/prefill_nodes.py",
             "                    node_id, list(lease.block_ids[got:last]), list(lease.prompt_token_ids), got,",
             "                    node_id, list(lease.block_ids[got:last])[::-1], list(lease.prompt_token_ids), got,",
             ("tests/test_bench_chaos.py",)),
    Mutation("blocks promoted from a lower tier land in reversed slots", "kvmesh/kv/tiers/tiered_cache.py",
             "        for h, block in zip(block_hashes, block_ids):",
             "        for h, block in zip(block_hashes, list(block_ids)[::-1]):",
             ("tests/test_tiers_cluster.py", "-k", "host_tier")),
    Mutation("an integrity failure inside a worker thread", "kvmesh/kv/block_pool.py",
             "    def check_integrity(self) -> None:\n",
             "    def check_integrity(self) -> None:\n"
             "        import threading\n"
             "        assert threading.current_thread() is threading.main_thread(), 'mutation'\n",
             ("tests/test_block_pool.py", "-k", "concurrent")),
    Mutation("a same-host writer's grants released at its lease's end while its process lives",
             "transfer/grants.py",
             "if g.writer_id == writer_id and not _alive(g)]",
             "if g.writer_id == writer_id]",
             ("tests/test_transfer_fences.py", "-k", "outliving_its_lease")),
    Mutation("a landing slot is trusted without its checksum", "transfer/landing.py",
             "        if not slots:\n            return 0\n",
             "        if not slots:\n            return 0\n"
             "        for s, b in zip(slots, block_ids):\n"
             "            self.kv_buffer[b].copy_(self.tensor[s].to(self.kv_buffer.device))\n"
             "        return len(slots)\n",
             ("tests/test_landing.py", "tests/test_transfer_fences.py", "-k", "damaged or checked")),
    Mutation("allocation's C walk never goes back for a parent that became a leaf",
             "kernels/extensions/block_index.c",
             "                    num_skipped = 0;\n                    block = PyLong_AsLong(PyList_GET_ITEM(next, sentinel));\n",
             "                    num_skipped = 0;\n",
             ("tests/test_block_pool.py", "-k", "same_on_both")),
    Mutation("the AVX-512 chain rotates by 16 where BLAKE2b rotates by 24",
             "kernels/extensions/blake2b_avx512.h",
             "        b = B2_XOR_ROTR(b, c, 24);",
             "        b = B2_XOR_ROTR(b, c, 16);",
             ("tests/test_block_hash.py",), requires="avx512f"),
    Mutation("the one-pass hash reads each block's tokens into the block before",
             "kernels/extensions/blake2b_chain.c",
             "convert_tokens(items, next, next + 16, size, data + 64 * (i + 1))",
             "convert_tokens(items, next, next + 16, size, data + 64 * i)",
             ("tests/test_block_hash.py",), requires="avx512f"),
    Mutation("the chain memo trusts an entry from before its block was allocated again",
             "kvmesh/kv/block_pool.py",
             "        if memo[0] != self._epoch[last]:",
             "        if False:",
             ("tests/test_block_pool.py", "-k", "memo_from_before")),
    Mutation("the paged prefill kernel skips the causal mask one step past the diagonal",
             "kernels/triton/attention.py",
             "    diagonal = (context_len + tile * BLOCK_M) // BLOCK_N * BLOCK_N",
             "    diagonal = (context_len + tile * BLOCK_M + BLOCK_N) // BLOCK_N * BLOCK_N",
             ("tests/test_kernels.py", "-k", "prefill")),
    Mutation("the fused RoPE multiplies the keys by the sine where the cosine belongs",
             "kernels/triton/fused.py",
             "    rotated = ((x.to(tl.float32) * cos)",
             "    rotated = ((x.to(tl.float32) * sin)",
             ("tests/test_kernels.py", "-k", "rope_store")),
    Mutation("the fused RMSNorm drops the residual from the stream it writes back",
             "kernels/triton/fused.py",
             "        tl.store(x_ptr + row * x_stride + cols, x, mask=mask)",
             "        tl.store(x_ptr + row * x_stride + cols, x - x, mask=mask)",
             ("tests/test_kernels.py", "-k", "rms_norm")),
    Mutation("a slicing node is priced as if it computed its queue first, whole", "kvmesh/node/planner.py",
             "    if slice_tokens <= 0:\n        return sum(queued)",
             "    if True:\n        return sum(queued)",
             ("tests/test_node_policies.py", "-k", "slices")),
    Mutation("the router never learns what fetches cost", "cluster/router.py",
             "            self.fetch_costs.record(chunk.node_id, chunk.cache, record.kv_layout.bytes_per_block // self.cfg.block_size)",
             "            pass  # mutation: nothing learned",
             ("tests/test_bench_cluster.py", "-k", "multi_turn")),
    Mutation("the attention metadata maps each token one block too far", "kernels/attention_metadata.py",
             "padded[rows, positions // block_size]",
             "padded[rows, (positions + block_size) // block_size % padded.shape[1]]",
             ("tests/test_paged_forward.py", "-k", "metadata_maps")),
    Mutation("a prompt-step replay keeps the previous step's padding tokens", "kvmesh/engine/prefill_graphs.py",
             "        if n < st.num_filled:  # tokens of the last step past this one's become padding",
             "        if False:  # mutation: stale tokens stay",
             ("tests/test_prefill_graphs.py", "-k", "replayed_prompt_steps")),
    Mutation("a row that stopped is read again from the step run ahead", "kvmesh/engine/run_ahead.py",
             "        live = [k for k, (seq, _) in enumerate(flight.batch) if seq.status is RequestStatus.RUNNING]",
             "        live = list(range(len(flight.batch)))",
             ("tests/test_run_ahead.py",)),
    Mutation("the block a step run ahead writes is not held", "kvmesh/engine/run_ahead.py",
             "            self.pool.touch(held)",
             "            held = ()",
             ("tests/test_run_ahead.py", "-k", "held")),
    Mutation("a grant admits writes after its deadline", "transfer/grants.py",
             " or time.monotonic() > grant.expires_at or \\\n",
             " or \\\n",
             ("tests/test_landing.py", "-k", "inside_its_blocks")),
    Mutation("a grant admits writes outside its blocks", "transfer/grants.py",
             "                        not all(b in allowed for b in range(first, last + 1)):",
             "                        False:",
             ("tests/test_landing.py", "-k", "inside_its_blocks")),
    Mutation("sweep releases a quarantine while its writer's process lives", "transfer/grants.py",
             "                (g.writer_alive is not None and not _alive(g)) or",
             "                (g.writer_alive is not None) or",
             ("tests/test_landing.py", "-k", "live_writers_quarantine")),
    Mutation("a non-streamed answer cut off midway is returned as a partial 200", "cluster/http_server.py",
             "            return _error(503, f\"the answer was cut off: {e}\", \"service_unavailable\")",
             "            rests = [[] for _ in streams]  # mutation: whatever arrived is the answer",
             ("tests/test_router_limits.py", "-k", "cut_off_midway")),
    Mutation("n choices ignore their seeds", "cluster/openai_protocol.py",
             "replace(base, seed=base.seed + j) if base.seed is not None else base",
             "replace(base, seed=None)",
             ("tests/test_router.py", "-k", "n_choices")),
    Mutation("fresh prompts' SDPA gets the keys before their rotation", "kvmesh/model/llama.py",
             "            q = ops.rope_store(qkv, *rope, k_cache, v_cache, md, self.num_heads, keys_out=k)",
             "            q = ops.rope_store(qkv, *rope, k_cache, v_cache, md, self.num_heads, keys_out=k)\n"
             "            k = qkv[:, self.split_sizes[0]: self.split_sizes[0] + self.split_sizes[1]].view_as(k)",
             ("tests/test_kernels.py", "-k", "fresh_prompts_take_sdpa")),
    Mutation("a decode node gives up on a prefill node at the bare timeout, its promise ignored",
             "decode_node/prefill_nodes.py",
             "            timeout_s = min(self._timeout_s + patience_s, m.MAX_WAIT_MS / 1000)",
             "            timeout_s = self._timeout_s",
             ("tests/test_planner.py", "-k", "within_its_promise")),
    Mutation("a decode node gives up on a forced prefill conversation at the bare timeout",
             "decode_node/prefill_nodes.py",
             "            patience_s = wanted_within_s if local_s > 0 else self.expected_s(node_id, num_tokens)",
             "            patience_s = wanted_within_s",
             ("tests/test_planner.py", "-k", "expected_time")),
    Mutation("the role balancer leaves an idle role's node idle while the other role works",
             "cluster/role_balancer.py",
             "        elif (decode >= cfg.high and prefill <= cfg.low) or (decode >= cfg.low and prefill <= cfg.idle):",
             "        elif decode >= cfg.high and prefill <= cfg.low:",
             ("tests/test_role_balancer.py", "-k", "idle_role")),
    Mutation("the role balancer repeats a move that did not relieve its pressure", "cluster/role_balancer.py",
             "        if verdict == self.unhelpful:",
             "        if False:",
             ("tests/test_role_balancer.py", "-k", "did_not_relieve")),
    Mutation("the AVX2 decode attention sums the first half of every key row twice", "kernels/cpu/decode_attention.c",
             "    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));",
             "    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x20));",
             ("tests/test_cpu_kernels.py", "-k", "native_decode_attention_matches"), requires="avx2 fma !avx512f"),
    Mutation("an embedded etcd takes another etcd answering on its port for its own", "metadata/embedded_etcd.py",
             "                if healthy and self._answered_by_us(advertised):",
             "                if healthy:",
             ("tests/test_metadata.py", "-k", "another_etcd")),
    Mutation("the decode thread chooser keeps the slower count", "kvmesh/node/decode_threads.py",
             "        state.choice = more if more_s < fewer_s * (1 - self.margin) else fewer",
             "        state.choice = more if more_s > fewer_s * (1 - self.margin) else fewer",
             ("tests/test_core_share.py", "-k", "chooser")),
    Mutation("a server that bench serve started outlives a killed benchmark", "kvmesh/bench/serve_bench.py",
             "    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(), **kwargs)",
             "    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)",
             ("tests/test_lifecycle.py", "-k", "bench_serve")),
    Mutation("a node's stats walk every frozen object for their count", "kvmesh/gc_pauses.py",
             '        return {"gc_frozen_objects": num_frozen(), "gc_collections": list(self.num_collections),',
             '        return {"gc_frozen_objects": gc.get_freeze_count(), "gc_collections": list(self.num_collections),',
             ("tests/test_gc_pauses.py",)),
    Mutation("serve's nodes never get its --prompt-slice-ms", "cluster/serve.py",
             '           "--prompt-slice-ms", repr(args.prompt_slice_ms)]',
             '           ]',
             ("tests/test_priorities.py", "-k", "slice")),
    Mutation("a node's prompt slice ignores --prompt-slice-ms", "kvmesh/node/landing_bound.py",
             "    tokens = int(prefill_tokens_per_s * slice_s) // block_size * block_size",
             "    tokens = int(prefill_tokens_per_s * PROMPT_SLICE_S) // block_size * block_size",
             ("tests/test_priorities.py", "-k", "slice")),
    Mutation("a forked node keeps the fork server's environment, not its launcher's", "cluster/node_forkserver.py",
             '    os.environ.update(request["env"])',
             '    os.environ.update({})',
             ("tests/test_node_forkserver.py", "-k", "environment")),
    Mutation("a node killed by a signal reports a clean exit", "cluster/node_forkserver.py",
             '_reply(sock, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})',
             '_reply(sock, {"pid": pid, "returncode": max(0, os.waitstatus_to_exitcode(status))})',
             ("tests/test_node_forkserver.py", "-k", "signal")),
    Mutation("loads starting together each convert the GGUF", "kvmesh/model/gguf_loader.py",
             '    with exclusive(entry.parent / f".{entry.name}.lock"):  # processes starting at once convert it once',
             '    if True:',
             ("tests/test_file_lock.py",)),
    Mutation("the native linear skips a row between two tiles",
             "kernels/cpu/linear_f32.c", "    for (int64_t r = 0; r < m; r += per_tile) {",
             "    for (int64_t r = 0; r < m; r += MAX_TILE_ROWS) {",
             ("tests/test_cpu_linear.py::test_native_linear_matches_a_float64_product",), requires="avx2 fma"),
    Mutation("the native linear adds the first panel's bias to every panel",
             "kernels/cpu/linear_f32.c", "bias ? bias + p * PANEL : NULL", "bias",
             ("tests/test_cpu_linear.py::test_native_linear_matches_a_float64_product",), requires="avx2 fma"),
    Mutation("the native linear leaves out a last partial group of panels",
             "kernels/cpu/linear_f32.c", "    int64_t groups = (panels + group - 1) / group;",
             "    int64_t groups = panels / group;",
             ("tests/test_cpu_linear.py::test_native_linear_matches_a_float64_product",), requires="avx2 fma"),
    Mutation("the AVX2 prefill attention's second row of a value pass takes the first row's probabilities",
             "kernels/cpu/prefill_attention.c", "__m256 p1 = _mm256_broadcast_ss(p + stride + t0 + j);",
             "__m256 p1 = _mm256_broadcast_ss(p + t0 + j);",
             ("tests/test_cpu_kernels.py", "-k", "prefill"), requires="avx2 fma !avx512f"),
    Mutation("a native linear's exported weight is its panels read as rows",
             "kernels/cpu/library.py", "packed.permute(0, 2, 1).reshape(", "packed.reshape(",
             ("tests/test_cpu_linear.py",), requires="avx2 fma"),
    Mutation("a prefill node sends the block before the prompt's partial last block as its tail",
             "prefill_node/worker.py", "seq.block_ids[(seq.num_prompt_tokens - 1) // self.cfg.block_size]",
             "seq.block_ids[(seq.num_prompt_tokens - 1) // self.cfg.block_size - 1]",
             ("tests/test_cluster.py", "-k", "last_block and zmq")),
    Mutation("a lease that reaches the prompt's last block offers no tail", "kvmesh/engine/kv_connector.py",
             "tail=end == last // bs and (last % bs > 0 or seq.params.argmax_only)", "tail=False",
             ("tests/test_kv_connector.py", "-k", "tail")),
    Mutation("the planner leaves out the partial last block a prefill node would send", "kvmesh/node/planner.py",
             "        return (req.end - block) * bs + req.tail_tokens", "        return (req.end - block) * bs",
             ("tests/test_planner.py",)),
    Mutation("a prefill node is asked to beat the request's own time, the streams' wait left out",
             "decode_node/fetcher.py", "order, plan.local_cost, reserved, trace_context)",
             "order, plan.local_seconds, reserved, trace_context)",
             ("tests/test_planner.py", "-k", "beat_the_cost")),
    Mutation("a draining node hands back a stream whose KV is on its way", "decode_node/worker.py",
             "if unstarted_only and (request.seq.output_token_ids or self.loads.loading(rid)):",
             "if unstarted_only and request.seq.output_token_ids:",
             ("tests/test_role_change.py", "-k", "on_its_way and zmq")),
    Mutation("a decode node counts a tail's whole block as pushed by the prefill node", "decode_node/worker.py",
             "landed = seq.num_computed_tokens", "landed = result.got * bs",
             ("tests/test_cluster.py", "-k", "last_block and zmq")),
    Mutation("a decode node ignores the first token that came with a greedy request's KV",
             "kvmesh/engine/kv_connector.py", "            self._engine.accept_first_token(seq, *report.first_token)",
             "            pass", ("tests/test_kv_connector.py", "-k", "first_token")),
    Mutation("a sampled request takes the prefill node's greedy pick as its first token",
             "kvmesh/engine/kv_connector.py", "report.got > lease.end and seq.params.argmax_only and",
             "report.got > lease.end and", ("tests/test_kv_connector.py", "-k", "first_token")),
    Mutation("a first token at landing leaves the prompt's last token to compute again", "kvmesh/engine/engine.py",
             "        seq.num_computed_tokens = seq.num_prompt_tokens\n",
             "        seq.num_computed_tokens = seq.num_prompt_tokens - 1\n",
             ("tests/test_kv_connector.py", "-k", "first_token")),
    Mutation("a prefill node sends the prompt's last token as the token after it", "prefill_node/worker.py",
             "prefill.first_token = (seq.output_token_ids[0], seq.output_logprobs[0])",
             "prefill.first_token = (seq.prompt_token_ids[-1], seq.output_logprobs[0])",
             ("tests/test_cluster.py", "-k", "last_block and zmq")),
    Mutation("a holder's final answer leaves out the token after the prompt", "transfer/holder.py",
             "                first = self.compute.first_token(push.request_id)", "                first = None",
             ("tests/test_cluster.py", "-k", "last_block and zmq")),
    Mutation("what commands stream between two steps waits for the next step's end", "kvmesh/node/engine_loop.py",
             "            if self._after_commands is not None:\n                self._after_commands()\n", "",
             ("tests/test_engine_loop.py",)),
    Mutation("the front ends' signal raises inside the event loop again", "cluster/serve.py",
             "            loop.call_soon_threadsafe(stop.set)\n", "            raise KeyboardInterrupt\n",
             ("tests/test_lifecycle.py", "-k", "event_never")),
    Mutation("bench serve counts a prompt sent after a gap as beside it", "kvmesh/bench/serve_bench.py",
             "for _, first in pending[:bisect.bisect_left(starts, b)])", "for _, first in pending)",
             ("tests/test_router.py", "-k", "splits_gaps")),
    Mutation("a decode step another node shared the cores of is a chooser sample", "kvmesh/node/core_share.py",
             "            if self.num_busy() == busy:\n", "            if True:\n",
             ("tests/test_core_share.py", "-k", "no_sample")),
    Mutation("the tier demoter's copies make an OpenMP team of their own", "kvmesh/kv/tiers/tiered_cache.py",
             "        serial_this_thread()  # its copies", "        pass  # its copies",
             ("tests/test_openmp_pool.py", "-k", "demoter")),
    Mutation("a serial side thread keeps its OpenMP thread count", "kvmesh/openmp_pool.py",
             "    lib.omp_set_num_threads(1)\n", "",
             ("tests/test_openmp_pool.py", "-k", "released_pool")),
    Mutation("a released OpenMP pool is kept", "kvmesh/openmp_pool.py",
             "    refused = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)\n", "    refused = 0\n",
             ("tests/test_openmp_pool.py", "-k", "released_pool")),
    Mutation("the benchmarks' memory warm-up touches one page in 64", "kvmesh/bench/memory_warmup.py",
             "        pages[::PAGE] = 1", "        pages[::PAGE * 64] = 1",
             ("tests/test_bench_cli.py", "-k", "memory_warmup")),
    Mutation("bench serve keeps a turn's server alive through the later turns", "kvmesh/bench/serve_bench.py",
             "target = _open_target(this_turn, name, args, ctx_per_slot, res)",
             "target = _open_target(whole_run, name, args, ctx_per_slot, res)",
             ("tests/test_bench_cli.py", "-k", "for_its_turn")),
    Mutation("bench serve keeps the last life's decode steps of a target only", "kvmesh/bench/serve_bench.py",
             "            have = into.setdefault(node, {}).setdefault(threads, {\"steps\": 0, \"mean_ms\": 0.0})",
             "            have = into.setdefault(node, {})[threads] = {\"steps\": 0, \"mean_ms\": 0.0}",
             ("tests/test_bench_cli.py", "-k", "adds_up")),
)

ASSERTION_FAILURES = ("AssertionError", "assert ", "Failed: DID NOT RAISE", "Failed: ")


def _run_tests(tests: tuple[str, ...]) -> tuple[int, list[str]]:
    """(pytest's exit code, the ids of tests that failed in their body on an assertion)."""
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              "-p", "no:randomly", f"--junitxml={report.name}", *tests],
                             cwd=ROOT, capture_output=True, text=True)
        try:
            cases = ET.parse(report.name).getroot().iter("testcase")
        except ET.ParseError:  # no report: pytest itself failed
            return res.returncode or 1, []
        asserted = []
        for case in cases:
            failure = case.find("failure")
            message = "" if failure is None else failure.get("message", "")
            if failure is not None and message.startswith(ASSERTION_FAILURES) and "Timeout" not in message:
                asserted.append(f"{case.get('classname')}::{case.get('name')}")
        return res.returncode, asserted


def run_one(mutation: Mutation) -> tuple[str, float]:
    """Run the tests clean, then apply, run them again and restore; returns (verdict, seconds)."""
    path = ROOT / mutation.path
    original = path.read_text()
    if original.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the snippet to replace is not in {mutation.path} exactly once")
    flags = cpu_flags()
    for flag in mutation.requires.split():
        if (flag[1:] in flags) if flag.startswith("!") else (flag not in flags):
            return f"n/a ({'has ' + flag[1:] if flag.startswith('!') else 'no ' + flag})", 0.0
    started = time.monotonic()
    clean_code, _ = _run_tests(mutation.tests)
    if clean_code != 0:
        return "FAILS CLEAN", time.monotonic() - started
    try:
        path.write_text(original.replace(mutation.old, mutation.new))
        code, asserted = _run_tests(mutation.tests)
    finally:
        path.write_text(original)
    verdict = "caught" if code != 0 and asserted else "MISSED"
    return verdict, time.monotonic() - started


def main() -> int:
    rows = []
    for mutation in MUTATIONS:
        verdict, seconds = run_one(mutation)
        rows.append((mutation.name, verdict, f"{seconds:.0f} s"))
        print(f"{verdict:11} {mutation.name} ({rows[-1][2]})", flush=True)
    missed = [r for r in rows if r[1] != "caught" and not r[1].startswith("n/a")]
    applicable = [r for r in rows if not r[1].startswith("n/a")]
    print(f"{len(applicable) - len(missed)} of {len(applicable)} breakages caught"
          f"{f' ({len(rows) - len(applicable)} need what this CPU lacks)' if len(applicable) < len(rows) else ''}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
