"""Clocks and counters: how long a call takes, how busy the GPU was, and what the engine counted.

A device's work is asynchronous, so every clock here synchronizes before it starts and before it
stops. The engine's statistics are cumulative (warm-up included): the figures of one timed call
are the difference of two snapshots of its counters, taken around the call.
"""
import gc
import time
from collections import Counter

import torch


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def seconds_per_call(fn, device: str, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy (each copy reads n and writes n bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda: dst.copy_(src), device, iters)
    del src, dst
    free_memory()
    return 2 * nbytes / seconds


def busy_share(spans: list[tuple[float, float]]) -> float | None:
    """The union of the intervals' lengths / the span from the first start to the last end."""
    if not spans:
        return None
    spans = sorted(spans)
    busy, reach = 0.0, spans[0][0]
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy / (reach - spans[0][0]) if reach > spans[0][0] else None


def gpu_busy_share(llm, prompts: list[list[int]], new_tokens: int) -> float | None:
    """Share of a generate call's GPU span during which a kernel or a copy ran (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from nanograph import SamplingParams
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    return busy_share([(e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA])


CALL_COUNTERS = ("prefix_cache_hit_tokens", "preemptions", "overlap_discarded_tokens")


def graph_counters(stats) -> dict:
    """The cumulative counters of a GraphStats (nanograph/engine/cuda_graph.py)."""
    return {"replays": Counter(stats.replays), "eager": Counter(stats.eager),
            "real_rows": stats.real_rows, "real_tokens": stats.real_tokens}


def counters(llm) -> dict:
    """The engine's cumulative counters, to take their difference around one call."""
    stats = llm.stats()
    out = {key: stats[key] for key in CALL_COUNTERS if key in stats}
    out["steps"] = Counter(stats.get("steps", {}))  # scheduled steps by kind
    if llm.runner.graphs is not None:
        out.update(graph_counters(llm.runner.graphs.stats))
    return out


def call_figures(before: dict, after: dict) -> dict:
    """The figures of one call alone, from the counters before and after it."""
    out = {key: after[key] - before[key] for key in CALL_COUNTERS if key in after}
    if "steps" in after:
        out["steps"] = {kind: after["steps"][kind] - before["steps"][kind]
                        for kind in ("decode", "mixed", "prefill")}
    if "replays" in after:
        from nanograph.engine.cuda_graph import GraphStats
        call = GraphStats(  # Counter subtraction drops the buckets the call did not use
            replays=after["replays"] - before["replays"],
            eager=after["eager"] - before["eager"],
            real_rows=after["real_rows"] - before["real_rows"],
            real_tokens=after["real_tokens"] - before["real_tokens"],
        )
        capture = ("capture_seconds", "graph_memory_bytes")
        out.update({k: v for k, v in call.as_dict().items() if k not in capture})
    return out
