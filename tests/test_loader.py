"""A damaged checkpoint is a clear ValueError naming what is wrong, never a model with garbage
weights; a sharded checkpoint as HF writes it loads and matches HF greedy (CPU, float32)."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import hf_greedy
from nanograph import LLM, SamplingParams


def load(path):
    return LLM(str(path), kvcache_block_size=16, num_kvcache_blocks=8)


def damaged(tiny_model, tmp_path, edit):
    """A copy of the tiny Qwen3 checkpoint (tied embeddings) whose tensors went through edit(dict)."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_missing_tensor_is_named(tiny_model, tmp_path):
    path = damaged(tiny_model, tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) the model needs.*model.layers.1.mlp.down_proj.weight") as e:
        load(path)
    assert str(path) in str(e.value)


def test_missing_shard_of_a_fused_weight_is_named(tiny_model, tmp_path):
    path = damaged(tiny_model, tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match="missing from the checkpoint: model.layers.0.self_attn.k_proj.weight"):
        load(path)


def test_many_missing_tensors_are_counted(tiny_model, tmp_path):
    def drop_layer_1(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            del tensors[name]
    with pytest.raises(ValueError, match=r"model.*: 11 tensor\(s\) the model needs.*, \.\.\.$"):
        load(damaged(tiny_model, tmp_path, drop_layer_1))


def test_unknown_tensor_is_named(tiny_model, tmp_path):
    path = damaged(tiny_model, tmp_path, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4)}))
    with pytest.raises(ValueError, match="no place for: model.layers.0.mlp.extra_proj.weight"):
        load(path)


def test_known_unused_tensors_are_ignored(tiny_model, tmp_path):
    def add_unused(tensors):  # a rotary cache, and the tied LM head stored a second time
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    llm = load(damaged(tiny_model, tmp_path, add_unused))
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]) == 3


def test_wrong_shape_is_named(tiny_model, tmp_path):
    path = damaged(tiny_model, tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)}))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight in .*model.safetensors.* "
                                         r"has shape \(8, 8\); the model expects \(128, 64\)"):
        load(path)


def test_truncated_file_is_named(tiny_model, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        load(path)


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory):
    """The tiny Llama checkpoint (untied LM head) saved by HF in several shards with an index."""
    path = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).save_pretrained(
        path, max_shard_size="100KB")
    shutil.copy(os.path.join(tiny_model("llama"), "generation_config.json"), path)
    return path


def test_sharded_checkpoint_matches_hf(sharded):
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    prompts = [[5, 6, 7], list(range(2, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = load(sharded).generate(prompts, greedy, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_greedy(str(sharded), prompts, 8)


def test_shard_missing_from_index_is_named(sharded, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(sharded, path)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"shard '{shard.name}', named in .*index.json, is missing"):
        load(path)
