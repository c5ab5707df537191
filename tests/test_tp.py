"""Tensor parallelism: 2 ranks give the same greedy tokens as 1 rank on the same float32 weights
(CPU over gloo in CI, and on 2 GPUs over NCCL with decode graphs); start-up and shutdown leave no
process behind; a dead worker is an error, not a hang."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from conftest import COMMON, FAMILIES
from nanograph import LLM, SamplingParams
from test_engine import random_prompts
from test_overlap import mixed_requests

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# the tests run on the CPU (gloo), and the ones that take this also on 2 GPUs (NCCL, decode graphs)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs")])]


def greedy_tokens(path, prompts, params=GREEDY, generations=1, device="cpu", **kwargs):
    """Token ids of `generations` identical generate calls, and the stats, at tp=1 then at tp=2."""
    results = []
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, device=device, **kwargs) as llm:
            outs = [[o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
                    for _ in range(generations)]
            results.append((outs, llm.stats()))
    assert not multiprocessing.active_children()
    return results


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory):
    """One KV head for four query heads: with 2 ranks the KV head is replicated, not split. An odd
    vocabulary, too: the last rank's embedding and LM-head shard is padded."""
    torch.manual_seed(0)
    cfg = Qwen3Config(**{**COMMON, "vocab_size": 321}, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("qwen3_mqa")
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=1, bos_token_id=0).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", list(FAMILIES) + ["qwen3_mqa"])
def test_tp2_matches_tp1(tiny_model, mqa_model, family):
    path = mqa_model if family == "qwen3_mqa" else tiny_model(family)
    prompts = random_prompts([3, 17, 40, 33, 64])
    (one, _), (two, stats) = greedy_tokens(path, prompts, enable_prefix_caching=False)
    assert two == one
    assert stats["num_kvcache_blocks"] > 0 and stats["attention_backend"] == "torch"


def test_tp2_with_prefix_caching_and_preemption(tiny_model):
    shared = random_prompts([40], seed=7)[0]
    prompts = [shared + t for t in random_prompts([3, 9, 14, 20, 6], seed=8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # ~5 x 85 tokens need ~30 blocks of 16; 14 force preemption; the 2nd call hits the prefix cache;
    # prompts in chunks of 32 tokens, beside the decodes (mixed steps)
    (one, s1), (two, s2) = greedy_tokens(tiny_model("qwen2"), prompts, params, generations=2, num_kvcache_blocks=14,
                                         max_num_batched_tokens=32)
    assert two == one and two[0] == two[1]
    assert s2["preemptions"] == s1["preemptions"] > 0 and s2["steps"] == s1["steps"]
    assert s2["steps"]["mixed"] > 0
    assert s2["prefix_cache_hit_tokens"] == s1["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_with_overlap_matches_tp1_without(tiny_model, device):
    """The control message goes out while the previous step runs, and every rank resolves the
    placeholders from the ids it sampled itself: same tokens, EOS, seeds and top-p included."""
    path = tiny_model("qwen3")
    prompts, params, eos = mixed_requests(path)
    outs = []
    for tp, overlap in ((1, False), (2, True)):
        with LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, device=device, overlap_scheduling=overlap,
                 dtype="float32", cuda_graph_sizes=[1, 2, 4, 8], max_num_batched_tokens=64) as llm:
            llm.eos_ids = frozenset({eos})
            outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
            stats = llm.stats()
    assert outs[1] == outs[0] and stats["overlap_discarded_tokens"] > 0 and stats["steps"]["mixed"] > 0
    if device == "cuda":  # the mixed steps replay mixed graphs on both ranks
        assert stats["mixed_graph_replays"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_lora_matches_tp1(tiny_model, adapters, device):
    """Column-parallel layers keep all of A and their rows of B, row-parallel ones their columns
    of A and all of B; with 2 slots for 3 adapters the workers follow rank 0's slot loads."""
    path, reqs = tiny_model("llama"), adapters("llama")
    prompts = random_prompts([5, 17, 30, 9, 12], seed=11)
    loras = [reqs["qv8"], None, reqs["all16"], reqs["mlp4"], reqs["qv8"]]
    outs = []
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, device=device, enable_lora=True, max_loras=2,
                 max_lora_rank=16, dtype="float32", cuda_graph_sizes=[1, 2, 4, 8], max_num_batched_tokens=24) as llm:
            outs.append([o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)])
            assert llm.stats()["steps"]["mixed"] > 0
    assert outs[1] == outs[0]


def assert_rank0_share(llm, path):
    """Rank 0's layers hold its share of the checkpoint: the first half of the heads (of Q, K, V:
    4 and 2 heads of 32), of gate and up, of O's and down's columns, of the (tied) vocabulary."""
    whole = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    layer = "model.layers.0."
    attention, mlp = llm.runner.model.model.layers[0].self_attn, llm.runner.model.model.layers[0].mlp
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1) and llm.runner.kv_cache.shape[-2] == 1
    q, k, v, o, gate, up, down = (whole[f"{layer}{name}.weight"] for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))
    assert torch.equal(attention.qkv_proj.weight, torch.cat([q[:64], k[:32], v[:32]]))
    assert torch.equal(attention.o_proj.weight, o[:, :64])
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[:64], up[:64]]))
    assert torch.equal(mlp.down_proj.weight, down[:, :64])
    embed = llm.runner.model.model.embed_tokens.weight
    assert torch.equal(embed, whole["model.embed_tokens.weight"][:160]) and llm.runner.model.lm_head.weight is embed


def test_start_close_twice_leaves_no_process(tiny_model):
    prompts = random_prompts([5, 20])
    outs = []
    for _ in range(2):
        llm = LLM(tiny_model("qwen3"), tensor_parallel_size=2, kvcache_block_size=16, device="cpu")
        workers = list(llm.runner.procs)
        assert len(workers) == 1 and workers[0].is_alive()
        assert_rank0_share(llm, tiny_model("qwen3"))
        outs.append(llm.generate(prompts, GREEDY, use_tqdm=False))
        # the layers shard over the process-wide default group: one tensor-parallel LLM at a time
        with pytest.raises(RuntimeError, match="close the other tensor-parallel LLM first"):
            LLM(tiny_model("qwen3"), tensor_parallel_size=2, kvcache_block_size=16, device="cpu")
        # (one without tensor parallelism uses no group: it runs beside)
        single = LLM(tiny_model("qwen3"), kvcache_block_size=16, device="cpu")
        assert single.generate(prompts, GREEDY, use_tqdm=False) == outs[-1]
        single.close()
        assert llm.generate(prompts, GREEDY, use_tqdm=False) == outs[-1]
        llm.close()
        llm.close()  # idempotent
        assert not multiprocessing.active_children() and workers[0].exitcode == 0
        assert not torch.distributed.is_initialized()
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0] == outs[1]


def test_heads_that_do_not_split_are_refused(tiny_model):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the attention heads \(4\)"):
        LLM(tiny_model("qwen3"), tensor_parallel_size=3, device="cpu")
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()


@pytest.mark.parametrize("when", ["between_steps", "mid_step"])
def test_dead_worker_raises_instead_of_hanging(tiny_model, monkeypatch, when):
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, kvcache_block_size=16, device="cpu")
    llm.generate(random_prompts([8]), GREEDY, use_tqdm=False)
    runner, worker = llm.runner, llm.runner.procs[0]
    if when == "mid_step":  # hide the death from the check before the step: rank 0 meets it in a collective
        checks = iter([None])
        monkeypatch.setattr(runner, "dead_worker", lambda wait_s=0.0, real=runner.dead_worker:
                            next(checks, None) if wait_s == 0.0 else real(wait_s))
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\)"):
        llm.generate(random_prompts([8, 30]), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(random_prompts([8]), GREEDY, use_tqdm=False)


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie waiting for its reaper is gone too
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("parent_end", ["exit_without_close", "killed"])
def test_workers_do_not_outlive_their_parent(tiny_model, parent_end):
    script = f"""
import os, signal
from nanograph import LLM
if __name__ == "__main__":
    llm = LLM({tiny_model("qwen3")!r}, tensor_parallel_size=2, kvcache_block_size=16, device="cpu")
    print(llm.runner.procs[0].pid, flush=True)
    if {parent_end == "killed"}:
        os.kill(os.getpid(), signal.SIGKILL)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == (-signal.SIGKILL if parent_end == "killed" else 0), proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(pid)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tp2_graphs_match_tp1_on_gpu(tiny_model, family):
    # decode batches shrink from 13 (eager: above the ladder) to 1, replaying every bucket;
    # each replay runs the captured NCCL all-reduces
    prompts = random_prompts([5 + 7 * i for i in range(13)], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(13)]
    (one, s1), (two, s2) = greedy_tokens(tiny_model(family), prompts, params, device="cuda", dtype="float32",
                                         cuda_graph_sizes=[1, 2, 4, 8])
    assert two == one
    assert s2["cuda_graph_sizes"] == [1, 2, 4, 8] and s2["replays_per_bucket"] == s1["replays_per_bucket"]
    assert 0 < s2["graph_hit_rate"] < 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_mixed_graphs_match_tp1_on_gpu(tiny_model):
    """Long prompts arrive while a request decodes: mixed steps replay mixed graphs (and their
    all-reduces) on both ranks, and give tp=1's tokens."""
    short, *longs = random_prompts([5, 150, 90], seed=4)
    results = []
    for tp in (1, 2):
        with LLM(tiny_model("llama"), tensor_parallel_size=tp, kvcache_block_size=16,
                 device="cuda", dtype="float32", max_num_mixed_tokens=64) as llm:
            ids = [llm.add_request(short, SamplingParams(temperature=0, max_tokens=40,
                                                         ignore_eos=True))]
            llm.step()
            llm.step()
            ids += [llm.add_request(prompt, GREEDY) for prompt in longs]
            outputs = {}
            while llm.has_unfinished_requests():
                outputs |= {out["request_id"]: out["token_ids"] for out in llm.step()}
            results.append(([outputs[i] for i in ids], llm.stats()))
    (one, stats1), (two, stats2) = results
    assert two == one
    assert stats2["mixed_graph_replays"] == stats1["mixed_graph_replays"] > 0


def test_tp2_with_a_draft_model_matches_tp1(tiny_model):
    """Speculative decoding with a draft model (the target's own weights) on a tensor-parallel
    target: the draft engine runs in the main process beside rank 0; the tokens are tp=1's."""
    draft = {"model": tiny_model("qwen3"), "num_speculative_tokens": 3, "disable_by_batch_size": 2,
             "disable_by_payoff": False}
    (one, _), (two, stats) = greedy_tokens(tiny_model("qwen3"), random_prompts([5, 23]),
                                           speculative_config=draft)
    assert two == one
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_tp2_with_an_fp8_cache_matches_tp1(tiny_model):
    """Each rank keeps its KV heads' share of the cache in e4m3: tp=1's tokens."""
    (one, _), (two, stats) = greedy_tokens(tiny_model("qwen3"), random_prompts([5, 23, 40]),
                                           kv_cache_dtype="fp8")
    assert two == one and stats["kv_cache_dtype"] == "float8_e4m3fn"
