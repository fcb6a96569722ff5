"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers' own models: tiny random configs made and
saved by transformers, loaded by kvmesh from the HF directory and from a GGUF file written the way llama.cpp's
converter writes one; the grouped expert path against a per-token loop; tensor-parallel experts; MoE blocks and
dense blocks never share a fingerprint."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.kernels.reference.moe import moe_experts
from kvmesh.model import load_model
from kvmesh.model.gguf_loader import load_gguf
from kvmesh.model.loader import LoadedModel, build_model
from kvmesh.model.presets import PRESETS
from tests.conftest import run_prefill

HF_CONFIGS = {  # transformers' own config classes and names: nothing here comes from kvmesh's mapping
    "qwen3_moe": dict(vocab_size=320, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1], max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=256, eos_token_id=257),
    "mixtral": dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None,
                    tie_word_embeddings=False, bos_token_id=256, eos_token_id=257),
}


def _hf_model(model_type: str):
    """transformers' model of the tiny config, weights drawn large enough that greedy choices are not ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **HF_CONFIGS[model_type]),
                                          dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return hf.eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def saved(request, tmp_path_factory):
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path))
    return request.param, hf, path


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_hf_directories_load_and_compute_what_transformers_does(saved):
    model_type, hf, path = saved
    loaded = load_model(str(path))
    assert loaded.config.architecture == model_type and loaded.config.is_moe
    gen = torch.Generator().manual_seed(3)
    for length in (1, 17, 130):
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        ours, _, _ = run_prefill(loaded, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4, (model_type, length)
    llm = LLM(str(path), num_kv_blocks=96, progress=False)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batched = llm.generate(prompts, params, use_tqdm=False)  # decodes of three sequences share each step
    for ids, out in zip(prompts, batched):
        assert out.token_ids == _hf_greedy(hf, ids, 24)
    again = llm.generate(prompts[2], params, use_tqdm=False)[0]  # its prompt cached: the rest recomputed on top
    assert again.token_ids == batched[2].token_ids and again.num_cached_tokens >= 32
    llm.engine.check_integrity()


def _write_gguf(path, model_type: str, hf) -> None:
    """The GGUF llama.cpp's converter writes: stacked experts, Q/K rows permuted for "llama" (Mixtral)."""
    import gguf

    cfg = HF_CONFIGS[model_type]
    arch = "qwen3moe" if model_type == "qwen3_moe" else "llama"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if model_type == "qwen3_moe":
        writer.add_key_length(16)
        writer.add_value_length(16)
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
    for name, tensor in hf.state_dict().items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] in memory: gate rows, then up rows
                gate, up = np.split(w, 2, axis=1)
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            if rest == "mlp.experts.down_proj":
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
                continue
            base = rest.removesuffix(".weight")
            if arch == "llama" and base == "self_attn.q_proj":
                w = permute(w, heads)
            elif arch == "llama" and base == "self_attn.k_proj":
                w = permute(w, kv_heads)
            writer.add_tensor(f"blk.{layer}.{names[base]}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_files_with_stacked_experts_compute_what_transformers_does(saved, tmp_path):
    model_type, hf, _ = saved
    path = tmp_path / "model.gguf"
    _write_gguf(path, model_type, hf)
    config, state = load_gguf(path, progress=False)
    assert config.architecture == model_type and config.num_experts_per_tok == HF_CONFIGS[model_type][
        "num_experts_per_tok"]
    model = build_model(config, state, torch.float32, torch.device("cpu"))
    loaded = LoadedModel(name=str(path), config=config, model=model, tokenizer=None, dtype=torch.float32,
                         device=torch.device("cpu"), fingerprint="", load_seconds=0.0)
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    ours, _, _ = run_prefill(loaded, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_grouped_experts_equal_a_per_token_loop():
    """Odd token counts, experts that get no token, every top-k up to all experts."""
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 6, 24, 10
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    for num_tokens in (1, 7, 33):
        x = torch.randn(num_tokens, hidden, generator=gen)
        for top_k in range(1, num_experts + 1):
            logits = torch.randn(num_tokens, num_experts, generator=gen)
            logits[:, 0] -= 100.0  # expert 0 is never chosen where k < E
            weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
            got = moe_experts(x, gate_up, down, ids, weights)
            want = torch.zeros_like(x)
            for t in range(num_tokens):
                for j in range(top_k):
                    e = int(ids[t, j])
                    g, u = (gate_up[e] @ x[t]).chunk(2)
                    want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (num_tokens, top_k)


def test_moe_and_dense_models_never_share_a_fingerprint():
    dense = dataclasses.replace(PRESETS["tiny-mixtral"].config, architecture="llama", num_experts=0,
                                num_experts_per_tok=0, moe_intermediate_size=0)
    moe = PRESETS["tiny-mixtral"].config
    assert moe.to_json() != dense.to_json()
    assert "num_experts" not in dense.to_json()  # dense fingerprints are what they were before experts existed
    fewer = dataclasses.replace(moe, num_experts_per_tok=1)
    assert fewer.to_json() != moe.to_json()


def test_a_moe_cluster_moves_and_reuses_kv_as_a_dense_one_does():
    """1 prefill + 2 decode nodes of tiny-mixtral over zmq: a prompt computed by the prefill node and pushed, then
    a second prompt sharing its first six blocks fetched from their holder; outputs and the received KV itself
    (the KV oracle, position by position) equal a single engine's."""
    from kvmesh.cluster.local_launcher import LocalCluster
    from tests.conftest import assert_same_kv
    from tests.test_cluster import REMOTE_ONLY, prompt, wait_until_published

    reference = LLM("tiny-mixtral", num_kv_blocks=256, progress=False)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    args = REMOTE_ONLY + ["--transfer-backend", "zmq", "--prefill-timeout", "30"]
    with LocalCluster(1, 2, model="tiny-mixtral", node_args=args, cluster="moe") as cluster:
        shared = prompt(700, 96)
        first, second = shared + prompt(701, 20), shared + prompt(702, 25)
        out1 = cluster.client("decode-0").generate(first, greedy)
        assert out1.error == "" and out1.stats.tokens_from_prefill_node >= 96
        wait_until_published(cluster, shared, 6, model="tiny-mixtral")
        out2 = cluster.client("decode-1").generate(second, greedy)
        want = [o.token_ids for o in reference.generate([first, second], greedy, use_tqdm=False)]
        assert [out1.token_ids, out2.token_ids] == want
        assert out2.stats.tokens_reused_remote + out2.stats.tokens_reused_prefill_node >= 96, out2.stats
        assert_same_kv(cluster.client("decode-1"), reference, second, min_blocks=(len(second) - 1) // 16)
        for node_id in cluster.nodes:
            assert cluster.client(node_id).stats(check=True)["num_pinned"] == 0
