"""The host side of the step loop without a model: per-step bookkeeping time, and how often
overlap scheduling has to wait for the step in flight.

    python -m tools.host_overhead

Part 1 times one decode step's host work (schedule, build the step with its sampling lists, fill
the graph buffers, account for the sampled tokens) for 256 sequences of the reference
workload's prompt lengths (benchmarks/workloads.py), block size 256, as in bench.py. With
overlap scheduling this work runs while the GPU computes the previous step, so it only costs
time where it is longer than the step itself.

Part 2 runs the whole reference workload through the real step loop (`LLM._run`, lookahead 1)
with a stand-in runner that returns token 1 for every row, and a KV cache of 2,511 blocks (what
an H100 gets for the Qwen3-0.6B shape at 0.9 memory utilisation): it counts the steps that could
not be scheduled while one was in flight, so the loop collected first and the GPU would have
idled for one step ("drains"), and the preemptions.
"""
import argparse
import random
import time
from collections import deque

import torch
from tqdm import tqdm

from benchmarks.workloads import reference_workload
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.cuda_graph import DecodeBuffers
from nanograph.engine.model_runner import InFlight
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.engine.step import build_step
from nanograph.llm import LLM
from nanograph.sampling_params import SamplingParams


def reference_sequences(block_size: int = 256) -> list[Sequence]:
    work = reference_workload()
    params = [SamplingParams(temperature=work.temperature, ignore_eos=True, max_tokens=n)
              for n in work.max_tokens]
    return [Sequence(i, prompt, p, block_size)
            for i, (prompt, p) in enumerate(zip(work.prompts, params))]


def time_decode_bookkeeping(steps: int = 200) -> None:
    scheduler = Scheduler(BlockManager(3000, 256, True), max_num_seqs=512, max_num_batched_tokens=16384)
    for seq in reference_sequences():
        seq.params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4096)
        scheduler.waiting.append(seq)
    while (batch := scheduler.schedule()).is_prefill:  # run the prefills
        scheduler.update(batch, [1] * len(batch.seqs))
    scheduler.update(batch, [1] * len(batch.seqs))
    buffers = DecodeBuffers(512, 16, "cpu")
    parts = dict.fromkeys(("schedule", "build", "fill", "update"), 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        step = build_step(batch, 256)
        t2 = time.perf_counter()
        buffers.fill(step, 256)
        t3 = time.perf_counter()
        scheduler.update(batch, [5] * len(batch.seqs))
        t4 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name] += dt
    print(f"batch {len(batch.seqs)}: " + ", ".join(f"{k} {v / steps * 1e6:.0f} us" for k, v in parts.items())
          + f"; total {sum(parts.values()) / steps * 1e6:.0f} us per decode step")


class StandInRunner:
    """launch/collect without a model: every row samples token 1."""

    def launch(self, batch) -> InFlight:
        return InFlight(batch, torch.ones(len(batch.seqs), dtype=torch.int64), None)

    @staticmethod
    def collect(launched: InFlight) -> list[int]:
        return launched.tokens.tolist()


def count_drains(num_blocks: int = 2511) -> None:
    llm = LLM.__new__(LLM)  # the real loop, around a scheduler and a stand-in runner
    llm.block_manager = BlockManager(num_blocks, 256, True)
    llm.scheduler = Scheduler(llm.block_manager, 512, 16384)
    llm.runner = StandInRunner()
    schedule, counts = llm.scheduler.schedule, {"prefill": 0, "decode": 0, "drains": 0}

    def counted_schedule():
        batch = schedule()
        if batch is None:
            counts["drains"] += 1
        else:
            counts["prefill" if batch.is_prefill else "decode"] += 1
        return batch
    llm.scheduler.schedule = counted_schedule
    for seq in reference_sequences():
        llm.scheduler.waiting.append(seq)
    llm._run(tqdm(disable=True), lookahead=1)
    assert llm.block_manager.num_free_blocks == num_blocks and not deque(llm.scheduler.running)
    print(f"reference workload, {num_blocks} KV blocks, overlap on: {counts['prefill']} prefill steps, "
          f"{counts['decode']} decode steps, {counts['drains']} drains, {llm.scheduler.num_preemptions} preemptions")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    random.seed(0)
    time_decode_bookkeeping()
    count_drains()
