"""Loaders: Hugging Face directories of every supported architecture, GGUF, presets, errors."""
from __future__ import annotations

import json

import pytest
import torch

from kvmesh.errors import UnknownModelError, UnsupportedModelError
from kvmesh.model import load_model
from tests.conftest import run_prefill

HF_CONFIGS = {
    "llama3-scaled": dict(model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "qwen2-bias": dict(model_type="qwen2"),
    "qwen3-qknorm": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True),
}


def _save_random_hf_model(tmp_path, model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, **overrides)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF's default init is too flat to tell implementations apart
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("variant", sorted(HF_CONFIGS))
def test_hf_directory_matches_transformers(tmp_path, variant):
    overrides = dict(HF_CONFIGS[variant])
    model_type = overrides.pop("model_type")
    hf = _save_random_hf_model(tmp_path, model_type, **overrides)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == model_type
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, _, _ = run_prefill(loaded, ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_fingerprint_tracks_weights_config_and_dtype(tmp_path):
    _save_random_hf_model(tmp_path, "llama")
    base = load_model(str(tmp_path)).fingerprint
    assert load_model(str(tmp_path)).fingerprint == base  # stable
    assert load_model(str(tmp_path), dtype="bfloat16").fingerprint != base
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rms_norm_eps"] = 1e-3
    cfg_path.write_text(json.dumps(cfg))
    changed_config = load_model(str(tmp_path)).fingerprint
    assert changed_config != base
    _save_random_hf_model(tmp_path, "llama", rms_norm_eps=1e-3, initializer_range=0.5)
    assert load_model(str(tmp_path)).fingerprint != changed_config  # new weights, same config
    assert load_model("tiny-llama").fingerprint != load_model("tiny-qwen3").fingerprint


def test_presets_are_deterministic():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    assert a.fingerprint == b.fingerprint
    for (name, p), (_, q) in zip(a.model.hf_state_dict().items(), b.model.hf_state_dict().items()):
        assert torch.equal(p, q), name
    assert a.model.hf_state_dict()["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_unknown_model_names_the_choices(tmp_path):
    with pytest.raises(UnknownModelError, match="tiny-llama"):
        load_model("no-such-model")
    with pytest.raises(UnknownModelError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads"):
        load_model(str(tmp_path))
    _save_random_hf_model(tmp_path, "llama")
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(UnknownModelError, match="safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architectures_are_refused(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.randn(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(path))
    hf_dir = tmp_path / "mamba"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_model(str(hf_dir))


def test_converted_weights_are_cached_whole_by_concurrent_writers(tmp_path, monkeypatch, tiny_llama):
    """Two processes converting one GGUF at once (two nodes starting on one machine): each writes under a name
    of its own and renames, so a reader never sees a half-written file and a failed write leaves nothing."""
    from kvmesh.model import gguf_loader

    state = {k: v.clone() for k, v in list(tiny_llama.model.hf_state_dict().items())[:3]}
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda path, progress=True: (tiny_llama.config, state))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"stand-in: load_gguf is replaced")
    entry = tmp_path / "cache" / "gguf" / gguf_loader.file_identity_key(source)
    seen = []

    def inner_writer(tmp):  # a second conversion runs to its end while the first is mid-write
        seen.append(sorted(p.name for p in entry.iterdir()))
        tmp.write_bytes(b"partial")
        gguf_loader._write_into_place(entry / "config.json", lambda t: t.write_text("{}"))
        assert (entry / "config.json").read_text() == "{}"
        raise OSError("the first writer dies mid-write")

    entry.mkdir(parents=True)
    with pytest.raises(OSError):
        gguf_loader._write_into_place(entry / "config.json", inner_writer)
    assert seen[0] and "config.json" not in seen[0]  # the final name appears only by rename
    assert sorted(p.name for p in entry.iterdir()) == ["config.json"]  # the dead writer's temp file is gone
    (entry / "config.json").unlink()
    config, loaded = gguf_loader.load_gguf_cached(source)
    assert config == tiny_llama.config and sorted(p.name for p in entry.iterdir()) == ["config.json",
                                                                                        "model.safetensors"]
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda *a, **k: pytest.fail("the cached copy was not used"))
    config, again = gguf_loader.load_gguf_cached(source)
    assert config == tiny_llama.config and all(torch.equal(again[k], state[k]) for k in state)
