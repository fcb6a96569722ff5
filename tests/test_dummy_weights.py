"""Dummy weights (``--load-format dummy``, the ``*-dummy`` presets): real shapes, seeded, the same everywhere.

The 8B shapes are checked against the parameter counts their publishers state and built on the
meta device (no memory); numerics run on scaled-down copies of the same configs.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import UnknownModelError
from kvmesh.model import load_model
from kvmesh.model.config import to_hf_dict
from kvmesh.model.dummy_weights import fill_dummy_weights, num_parameters
from kvmesh.model.fingerprint import digest_state_dict
from kvmesh.model.llama import LlamaForCausalLM
from kvmesh.model.presets import PRESETS
from tests.conftest import hf_reference, run_prefill

PUBLISHED_PARAMETERS = {  # the model cards' counts (tied embeddings once)
    "smollm2-135m-dummy": 134_515_008,
    "llama3.2-1b-dummy": 1_235_814_400,
    "llama3-8b-dummy": 8_030_261_248,
    "qwen3-8b-dummy": 8_190_735_360,
    "qwen3-30b-a3b-dummy": 30_532_122_624,
    "mixtral-8x7b-dummy": 46_702_792_704,
}


def _scaled_down(name: str) -> dict:
    """The preset's config with every size cut down, its architecture and ratios kept, as config.json."""
    config = dataclasses.replace(PRESETS[name].config, vocab_size=512, hidden_size=128, intermediate_size=352,
                                 num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16)
    return to_hf_dict(config)


def _dummy_directory(tmp_path, name: str):
    (tmp_path / "config.json").write_text(json.dumps(_scaled_down(name)))
    return tmp_path


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_dummy_presets_have_the_published_shapes(name):
    config = PRESETS[name].config
    assert PRESETS[name].dummy
    assert num_parameters(config) == PUBLISHED_PARAMETERS[name]
    with torch.device("meta"):
        model = LlamaForCausalLM.uninitialized(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


def test_load_format_dummy_reads_only_the_config(tmp_path):
    path = str(_dummy_directory(tmp_path, "llama3-8b-dummy"))
    with pytest.raises(UnknownModelError):
        load_model(path)  # no weights in the folder: the ordinary load has nothing to read
    with pytest.raises(UnknownModelError, match="load format"):
        load_model(path, load_format="safetensors-please")
    loaded = load_model(path, load_format="dummy")
    assert loaded.config.num_layers == 3 and loaded.config.rope_scaling is not None
    assert loaded.tokenizer.eos_token_ids == (128001,)  # the byte tokenizer ends at the model's own token


@pytest.mark.parametrize("name", ["llama3-8b-dummy", "qwen3-8b-dummy"])
def test_dummy_weights_keep_a_deep_model_finite_and_greedy_streams_equal_transformers(tmp_path, name):
    config = _scaled_down(name)
    config["num_hidden_layers"] = 24  # depth is what lets badly scaled activations run away
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), load_format="dummy")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, _, _ = run_prefill(loaded, ids)
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 30  # spread: greedy choices are not near-ties
    hf = hf_reference(loaded)
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0]
    assert (logits - reference).abs().max().item() < 1e-3
    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=64, progress=False)
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    assert len(out.token_ids) == 16 and out.token_ids == expected[0, len(ids):].tolist()
    llm.engine.check_integrity()


_FINGERPRINT_SCRIPT = """
import sys
from kvmesh.model import load_model
from kvmesh.model.fingerprint import digest_state_dict
m = load_model(sys.argv[1], load_format="dummy", dtype="bfloat16")
print(m.fingerprint, digest_state_dict(m.model.hf_state_dict()))
"""


def test_dummy_weights_are_the_same_in_every_process_and_change_with_the_seed(tmp_path):
    path = str(_dummy_directory(tmp_path, "qwen3-8b-dummy"))
    here = load_model(path, load_format="dummy", dtype="bfloat16")
    other = subprocess.run([sys.executable, "-c", _FINGERPRINT_SCRIPT, path], capture_output=True, text=True,
                           check=True, timeout=300).stdout.split()
    assert other == [here.fingerprint, digest_state_dict(here.model.hf_state_dict())]
    assert load_model(path, load_format="dummy", dtype="float32").fingerprint != here.fingerprint
    first, second = LlamaForCausalLM.uninitialized(here.config), LlamaForCausalLM.uninitialized(here.config)
    fill_dummy_weights(first, 1)
    fill_dummy_weights(second, 2)
    assert digest_state_dict(first.state_dict()) != digest_state_dict(second.state_dict())
