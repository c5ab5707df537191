"""Multi-LoRA: nanograph's greedy tokens equal HF + PEFT's, per request, in mixed batches of
adapters of different ranks and base-model requests; adapter slots, prefix caching and bad input.

The adapters (conftest.py) are made with PEFT's `init_lora_weights=False` (random A and B), so
they really change the output (asserted). CPU float32 here; the same on the GPU with decode graphs per
(batch, LoRA rank) bucket at the end.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import hf_greedy
from nanograph import LLM, LoRARequest, SamplingParams
from test_engine import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
def peft_greedy(model_dir: str, request: LoRARequest | None, prompt: list[int], max_tokens: int) -> list[int]:
    """The oracle: HF + PEFT (or HF alone for the base model), greedy, one prompt."""
    if request is None:
        return hf_greedy(model_dir, [prompt], max_tokens)[0]
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      request.path).eval()
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_mixed_batch_matches_peft(tiny_model, adapters, family):
    path, reqs = tiny_model(family), adapters(family)
    prompts = random_prompts([5, 17, 30, 9, 22, 40], seed=11)
    loras = [reqs["qv8"], None, reqs["all16"], reqs["mlp4"], reqs["qv8"], None]
    expected = [peft_greedy(path, r, p, GREEDY.max_tokens) for r, p in zip(loras, prompts)]
    base = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert all(e != b for e, b, r in zip(expected, base, loras) if r is not None)  # the adapters matter
    # prompts in chunks of 32 tokens beside the decodes (mixed steps, adapters on both parts)
    llm = LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o["token_ids"] for o in outs] == expected
    assert llm.stats()["steps"]["mixed"] > 0
    assert_all_blocks_free(llm)


def test_more_adapters_than_slots_are_served_in_turn(tiny_model, adapters):
    path, reqs = tiny_model("qwen3"), adapters("qwen3")
    prompts = random_prompts([8, 12, 16, 20, 24, 28], seed=12)
    loras = [reqs["qv8"], reqs["all16"], reqs["mlp4"], None, reqs["all16"], reqs["qv8"]]
    expected = [peft_greedy(path, r, p, GREEDY.max_tokens) for r, p in zip(loras, prompts)]
    llm = LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=1, max_lora_rank=16, overlap_scheduling=True)
    loads = []
    runner_launch = llm.runner.launch

    def launch(batch):
        lora_step = batch.extras.get("lora")  # (lora/slots.py)
        loads.extend(adapter.request.name for _, adapter in (lora_step.loads if lora_step else ()))
        assert len({s.adapter for s in batch.seqs if s.adapter}) <= 1  # one slot: one adapter a step
        return runner_launch(batch)
    llm.runner.launch = launch
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)] == expected
    assert set(loads) == {"qv8", "all16", "mlp4"}  # one slot, three adapters: each loaded (at least) once
    assert_all_blocks_free(llm)


def test_prefix_cache_is_keyed_by_adapter(tiny_model, adapters):
    path, reqs = tiny_model("qwen3"), adapters("qwen3")
    prompt = random_prompts([50], seed=13)[0]  # 3 full blocks of 16
    llm = LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    hits = []
    for name in ("qv8", "all16", None, "qv8"):
        before = llm.stats()["prefix_cache_hit_tokens"]
        request = reqs[name] if name else None
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0]["token_ids"]
        assert out == peft_greedy(path, request, prompt, GREEDY.max_tokens)
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
    assert hits == [0, 0, 0, 48]  # nothing shared across adapters; the second qv8 call reuses 3 blocks


def test_fold_gives_the_consumers_h_before_its_norm(tiny_model, adapters):
    """lora/layer.py's fold: a producer's folded parts times [its input | the residual stream],
    scaled by the consumer's norm's 1 / rms, equal the consumer's own shrink of
    norm(the producer's output, its LoRA delta included, + residual), for every fold of the
    model (o -> gate/up, down -> the next layer's q/k/v), on random inputs."""
    from nanograph.layers.norm import rms_norm
    from nanograph.lora.adapter import read_adapter

    path, request = tiny_model("qwen3"), adapters("qwen3")["all16"]
    llm = LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    extension, gen, rows, rank = llm.lora.runner_extension, torch.Generator().manual_seed(5), 3, 16
    extension.load(1, read_adapter(request, llm.config.hf_config, 16))
    assert len(extension.folds) == 2 * len(llm.runner.model.model.layers) - 1
    # a step of 3 rows on slot 1, through the torch path
    extension.adapters.slots, extension.adapters.rank = torch.ones(rows, dtype=torch.int32), rank
    try:
        for producer, consumer, norm in extension.folds:
            x = torch.randn(rows, producer.weight.shape[1], generator=gen)
            residual = torch.randn(rows, producer.weight.shape[0], generator=gen)
            y = producer(x)  # the torch path: x W^T + its own delta, from the first part of its buffers
            assert not torch.allclose(y, x @ producer.weight.T)  # the producer's own delta is there
            v = y + residual
            want = torch.einsum("tk,prk->tpr", rms_norm(v, norm.weight, norm.eps), consumer.lora_a[1, :, :rank])
            rstd = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
            got = torch.einsum("tk,prk->tpr", torch.cat([x, residual], 1), producer.lora_a[1, 1:, :rank])
            assert want.abs().max() > 0.1
            torch.testing.assert_close(got * rstd[:, :, None], want, rtol=1e-4, atol=1e-5)
    finally:
        extension.adapters.rank = 0


def damaged_adapter(request: LoRARequest, tmp_path, config=None, tensors=None) -> LoRARequest:
    path = tmp_path / "damaged"
    shutil.copytree(request.path, path)
    if config:
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        weights = load_file(path / "adapter_model.safetensors")
        save_file(tensors(weights), path / "adapter_model.safetensors")
    return LoRARequest("damaged", str(path))


def without_weights(request: LoRARequest, tmp_path) -> LoRARequest:
    damaged = damaged_adapter(request, tmp_path)
    os.remove(os.path.join(damaged.path, "adapter_model.safetensors"))
    return damaged


def rename_first(weights: dict, old: str, new: str) -> dict:
    key = next(k for k in weights if old in k)
    weights[key.replace(old, new)] = weights.pop(key)
    return weights


def test_bad_lora_input_is_a_clear_error_and_the_engine_stays_usable(tiny_model, adapters, tmp_path):
    path, reqs = tiny_model("qwen3"), adapters("qwen3")
    prompts = random_prompts([6, 7], seed=14)
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(path, kvcache_block_size=16).generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs["qv8"])
    llm = LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    cases = [
        (reqs["all16"], "rank 16 is above max_lora_rank=8"),
        (LoRARequest("gone", str(tmp_path / "nowhere")), "adapter_config.json not found"),
        (damaged_adapter(reqs["qv8"], tmp_path / "a", tensors=lambda w: rename_first(w, "layers.0.", "layers.7.")),
         "targets a module the model does not have"),
        (damaged_adapter(reqs["qv8"], tmp_path / "b", tensors=lambda w: rename_first(w, "q_proj", "x_proj")),
         "x_proj.*targets a module the model does not have"),
        (damaged_adapter(reqs["qv8"], tmp_path / "c", tensors=lambda w: {k: (v[:4] if "q_proj.lora_A" in k else v)
                                                                          for k, v in w.items()}),
         r"q_proj.lora_A.weight has shape \(4, 64\), expected \(8, 64\)"),
        (damaged_adapter(reqs["qv8"], tmp_path / "d", config={"use_dora": True}), "use_dora not supported"),
        (without_weights(reqs["qv8"], tmp_path / "e"), "adapter_model.safetensors not found"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=f"request 1: LoRA adapter .*{message}"):
            llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, request])
    with pytest.raises(ValueError, match="got 2 prompts but 3 lora requests"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, None, reqs["qv8"]])
    assert_all_blocks_free(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[reqs["qv8"], None])
    assert [o["token_ids"] for o in outs] == [peft_greedy(path, reqs["qv8"], prompts[0], 10),
                                              hf_greedy(path, prompts[1:], 10)[0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_mixed_batch_matches_peft_with_graphs(tiny_model, adapters, family):
    """A first prefill of 128 tokens (eager), then the other prompts join the decoding ones in
    mixed steps, on the mixed graphs of the largest rank bucket; decode batches shrink through
    the buckets [1, 2, 4, 8], in rank buckets 8 and 16, down to the longest request alone on an
    adapter of all seven projections: the BGMV kernels in and out of graphs, and the GEMV's."""
    path, reqs = tiny_model(family), adapters(family)
    prompts = random_prompts([5 + 4 * i for i in range(11)], seed=15)
    loras = ([None, reqs["mlp4"], reqs["all16"], reqs["qv8"]] * 3)[:11]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(11)]
    with LLM(path, kvcache_block_size=16, enable_lora=True, max_loras=3, max_lora_rank=16, dtype="float32",
             cuda_graph_sizes=[1, 2, 4, 8], max_num_mixed_tokens=64, max_num_batched_tokens=128) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        stats = llm.stats()
        mixed_with_adapters = sum(count for shape, count in llm.runner.graphs.stats.replays.items()
                                  if shape.prefill_tokens and shape.variant == 16)
    expected = [peft_greedy(path, r, p, sp.max_tokens) for r, p, sp in zip(loras, prompts, params)]
    assert [o["token_ids"] for o in outs] == expected
    # the decode ladder by rank 0, 8, 16, and the mixed grid by rank 0 and 16 (the largest)
    assert stats["graph_variants"] == [8, 16]
    assert stats["num_graphs"] == 12 + 2 * len(stats["mixed_graph_grid"])
    assert mixed_with_adapters > 0
    assert len(stats["replays_per_variant"]) >= 3 and stats["replays_per_variant"]["1x16"] > 0
    assert stats["graph_hit_rate"] == stats["mixed_graph_hit_rate"] == 1  # (the first step: prefill)
