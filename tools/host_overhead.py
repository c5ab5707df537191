"""The host side of the step loop without a model: per-step bookkeeping time, and how often
overlap scheduling has to wait for the step in flight.

    python -m tools.host_overhead

Part 1 times one decode step's host work (schedule, build the step with its sampling lists, fill
the graph buffers, account for the sampled tokens) for 256 sequences of the reference
workload's prompt lengths (benchmarks/workloads.py), block size 256, as in bench.py. With
overlap scheduling this work runs while the GPU computes the previous step, so it only costs
time where it is longer than the step itself.

Part 2 runs the whole reference workload through the step loop of `LLM._step` (lookahead 1)
with a stand-in runner that returns token 1 for every row, and a KV cache of 2,511 blocks (what
an H100 gets for the Qwen3-0.6B shape at 0.9 memory utilisation): it counts the steps that could
not be scheduled while one was in flight, so the loop collected first and the GPU would have
idled for one step ("drains"), and the preemptions.
"""
import argparse
import random
import time
from collections import deque


from benchmarks.workloads import reference_workload
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.cuda_graph import bucket_ladder, decode_shape, find_bucket
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.engine.step import StepBuffers, build_step
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
    while (batch := scheduler.schedule()).kind != "decode":  # run the prefills
        scheduler.update(batch, [1] * len(batch.rows))
    scheduler.update(batch, [1] * len(batch.rows))
    buffers = StepBuffers(max_tokens=16384 + 520, max_seqs=520, max_blocks=16, device="cpu")
    ladder = bucket_ladder(512)
    parts = dict.fromkeys(("schedule", "build", "fill", "update"), 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        step = build_step(batch, 256)
        t2 = time.perf_counter()
        buffers.fill(step, decode_shape(find_bucket(ladder, step.num_decodes)))
        t3 = time.perf_counter()
        scheduler.update(batch, [5] * len(batch.rows))
        t4 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name] += dt
    print(f"batch {len(batch.seqs)}: " + ", ".join(f"{k} {v / steps * 1e6:.0f} us" for k, v in parts.items())
          + f"; total {sum(parts.values()) / steps * 1e6:.0f} us per decode step")


def count_drains(num_blocks: int = 2511) -> None:
    """The loop of LLM._step with lookahead 1 around the real scheduler; every row samples token 1."""
    scheduler = Scheduler(BlockManager(num_blocks, 256, True), 512, 16384)
    for seq in reference_sequences():
        scheduler.waiting.append(seq)
    in_flight, drains = deque(), 0
    while scheduler.waiting or scheduler.running or in_flight:
        batch = scheduler.schedule()
        if batch is not None:
            in_flight.append(batch)
        else:
            drains += 1
        if len(in_flight) > 1 or (batch is None and in_flight):
            done = in_flight.popleft()
            scheduler.update(done, [1] * len(done.rows))
    assert scheduler.block_manager.num_free_blocks == num_blocks
    steps = dict(scheduler.steps)
    print(f"reference workload, {num_blocks} KV blocks, overlap on: steps {steps}, {drains} drains, "
          f"{scheduler.num_preemptions} preemptions")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    random.seed(0)
    time_decode_bookkeeping()
    count_drains()
