"""One shape's settings (`Setup`), and how every section builds a nanograph engine and times it.

Only the generation is timed: model building, KV-cache allocation, graph capture and a warm-up
generate (`warmup_workload`: other prompts, so no prefix-cache hits on the timed ones) are
outside the clock, for every engine alike; they are reported apart where they matter. An engine
sizes its KV cache from free device memory, so each one is freed before the next is built
(`run_nanograph` keeps it in its own frame) and bench warns if memory stayed allocated.
"""
import argparse
import os
import platform
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from benchmarks.report import RunResult, mib
from benchmarks.shapes import SHAPES, quick_shape, write_model_dir
from benchmarks.timing import call_figures, counters, free_memory, is_cuda, synchronize
from benchmarks.workloads import (REFERENCE_OUTPUT_TOKENS, Workload, make_workload, quick_workload,
                                  warmup_workload)


@dataclass
class Setup:
    """Everything the sections share for one shape: where the model is, how to build engines,
    the workload."""
    args: argparse.Namespace
    name: str
    model_dir: str
    load_format: str
    device: str
    dtype: str
    workload: Workload
    warmup: Workload
    max_token_id: int
    tmp: str  # the run's temporary directory (model configs, LoRA adapters)
    attention_backend: str = "auto"  # one of --attention-backend's, set by main for each in turn
    kv_cache_dtype: str = "auto"     # one of --kv-cache-dtype's, likewise

    def llm_kwargs(self, **overrides) -> dict:
        """The LLM's keyword arguments: the run's settings, then `overrides`."""
        kwargs = dict(load_format=self.load_format, dtype=self.dtype, device=self.device,
                      max_model_len=self.args.max_model_len, tensor_parallel_size=self.args.tp,
                      attention_backend=self.attention_backend, kv_cache_dtype=self.kv_cache_dtype)
        if self.args.num_kvcache_blocks:
            kwargs["num_kvcache_blocks"] = self.args.num_kvcache_blocks
        return kwargs | overrides

    def llm(self, **overrides):
        from nanograph import LLM
        return LLM(self.model_dir, **self.llm_kwargs(**overrides))


def build_setup(args: argparse.Namespace, tmp: str, name: str) -> Setup:
    """The Setup of shape `name` (or of --model): its config.json written under tmp."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    if args.model:
        from transformers import AutoConfig
        model_dir, load_format = args.model, "auto"
        if not os.path.isdir(model_dir):
            from nanograph.utils.loader import resolve_model_dir
            model_dir = resolve_model_dir(model_dir)
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    else:
        shape = quick_shape(name) if args.quick else name
        model_dir, load_format = write_model_dir(shape, tmp), "dummy"
        vocab = SHAPES[shape]["vocab_size"]
    max_token_id = min(10000, vocab - 1)
    workload = quick_workload() if args.quick else make_workload(max_token_id=max_token_id)
    if not args.quick and max_token_id == 10000:
        total = workload.output_tokens
        assert total == REFERENCE_OUTPUT_TOKENS, \
            f"reference workload has {total} output tokens, not {REFERENCE_OUTPUT_TOKENS}"
    warmup = warmup_workload(args.quick, max_token_id)
    if args.logprobs is not None:
        workload, warmup = (replace(w, logprobs=args.logprobs) for w in (workload, warmup))
    return Setup(args, name, model_dir, load_format, device, dtype, workload, warmup,
                 max_token_id, tmp)


def meta(setup: Setup, names: list[str]) -> dict:
    """The report's header: what ran, on what, with which versions."""
    import transformers
    cuda = is_cuda(setup.device)
    if cuda:
        device_name = torch.cuda.get_device_name(setup.device)
    else:
        device_name = platform.processor() or "cpu"
    return {"models": names, "load_format": setup.load_format, "device": setup.device,
            "dtype": setup.dtype, "tp": setup.args.tp, "quick": setup.args.quick,
            "max_model_len": setup.args.max_model_len, "device_name": device_name,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def report_leftover_memory(what: str) -> None:
    """After an engine is freed, the next one sizes its KV cache from free memory: say so if
    something (a reference cycle, a cache) kept a lot of device memory alive."""
    free_memory()
    if torch.cuda.is_available() and torch.cuda.memory_allocated() > 256 * 2**20:
        print(f"  (warning: {mib(torch.cuda.memory_allocated())} MiB still allocated after "
              f"freeing {what})")


def round_robin(adapters: list, n: int) -> list | None:
    """lora_request for n prompts: the adapters in turn; None (every prompt on the base model)
    without any."""
    return [adapters[i % len(adapters)] for i in range(n)] if adapters else None


def time_generate(llm, workload: Workload, device: str,
                  adapters: list = ()) -> tuple[list[list[int]], float]:
    params = workload.sampling_params()
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False,
                        lora_request=round_robin(adapters, workload.num_seqs))
    synchronize(device)
    seconds = time.perf_counter() - start
    return [o["token_ids"] for o in outs], seconds


def measure_generate(llm, setup: Setup, workload: Workload,
                     adapters: list = ()) -> tuple[list[list[int]], float, dict]:
    """Warm up, then time one generate of the workload (the adapters round-robin over the
    prompts, in both): (output token ids, seconds, its stats)."""
    warm = setup.warmup
    llm.generate(warm.prompts, warm.sampling_params(), use_tqdm=False,
                 lora_request=round_robin(adapters, warm.num_seqs))
    before = counters(llm)
    outs, seconds = time_generate(llm, workload, setup.device, adapters)
    stats = dict(llm.stats(), overlap_scheduling=llm.config.overlap_scheduling)
    stats.update(call_figures(before, counters(llm)))
    return outs, seconds, stats


def run_nanograph(setup: Setup, label: str, workload: Workload,
                  probe: Callable[..., dict] | None = None, **overrides) -> RunResult:
    """Build an engine, measure, free the engine (it lives only in this frame, so that its device
    memory is back before the next engine sizes its KV cache). `probe(llm, setup)`, if given,
    measures more on the same engine after the timed call (overlap.py's overlap_probe)."""
    print(f"  [{label}] building the engine, warming up, timing {workload.num_seqs} sequences ...",
          flush=True)
    llm = setup.llm(**overrides)
    try:
        outs, seconds, stats = measure_generate(llm, setup, workload)
        tokens = sum(map(len, outs))
        probed = probe(llm, setup) if probe else {}
    finally:
        llm.close()
        del llm
        report_leftover_memory(label)
    note = ""
    if tokens != workload.output_tokens:
        note = f"expected {workload.output_tokens} output tokens"
    return RunResult(label, workload.num_seqs, tokens, seconds, note, stats=stats, probe=probed)


def per_token_latency(llm, setup: Setup, prompt_len: int, new_tokens: int, seed: int,
                      temperature: float = 0.6) -> float | None:
    """Seconds per generated token of one sequence: (generate n tokens - generate 1) / (n - 1).
    Subtracting the 1-token run removes the prefill; fresh random prompts avoid prefix-cache
    hits; the best of three runs of each filters out noise. None if noise still wins (a loaded
    CPU). Temperature 0.6 as in the workload, 0 for greedy (the sampler runs inside the decode
    graph either way)."""
    from nanograph import SamplingParams
    rng = random.Random(seed)

    def once(n: int) -> float:
        prompt = [rng.randint(0, setup.max_token_id) for _ in range(prompt_len)]
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
        synchronize(setup.device)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        synchronize(setup.device)
        return time.perf_counter() - start

    once(new_tokens)  # warm-up
    one = min(once(1) for _ in range(3))
    many = min(once(new_tokens) for _ in range(3))
    return (many - one) / (new_tokens - 1) if many > one else None
