"""What a mixed step costs next to a decode step: the step time by the prefill tokens beside it.

    python -m tools.mixed_step_cost [--shape qwen3-0.6b] [--decodes 64] [--context 1000]
    python -m tools.mixed_step_cost --shape tiny --device cpu --decodes 4 --context 32 \
        --prefill-tokens 4,8                                   # a smoke run on a CPU

The scheduler's rule for a mixed step's prefill budget (engine/scheduler.py) trades the gap
between two tokens of every decoding sequence against how fast prompts get in; this measures
the price side. `--decodes` sequences of `--context` prompt tokens are prefilled and decoding;
then one long prompt is added and, for each budget, prefilled in chunks of that many tokens
beside them (the scheduler's budget fixed for the run). Each row is the mean wall time of a few
steps through `LLM.step()` (overlap scheduling off, so a step's time is its own: launch, replay
and the sampled ids back), with the share of those steps that replayed a mixed graph (none on a
CPU: no graphs there).
"""
import argparse
import random
import tempfile
import time

from benchmarks.shapes import SHAPES, write_model_dir
from benchmarks.timing import synchronize
from nanograph import LLM, SamplingParams

STEPS = 8  # timed steps per row


def timed_steps(llm: LLM, n: int) -> float:
    """Mean ms of n steps, after two untimed ones (a graph's first replays cost more)."""
    for _ in range(2):
        llm.step()
    synchronize(llm.config.device)
    start = time.perf_counter()
    for _ in range(n):
        llm.step()
    synchronize(llm.config.device)
    return (time.perf_counter() - start) / n * 1e3


def mixed_replays(llm: LLM) -> int:
    graphs = llm.runner.graphs
    return graphs.stats.as_dict()["mixed_graph_replays"] if graphs is not None else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--prefill-tokens", default="16,64,128,192,256,512,1024",
                   type=lambda text: [int(n) for n in text.split(",")])
    args = p.parse_args()
    path = write_model_dir(args.shape, tempfile.mkdtemp())
    long_prompt = args.context + (STEPS + 2) * max(args.prefill_tokens) + 16
    new_tokens = (STEPS + 2) * (len(args.prefill_tokens) + 2) + 64  # the decoding sequences outlast us
    llm = LLM(path, load_format="dummy", device=args.device, max_num_seqs=args.decodes + 1,
              overlap_scheduling=False, enable_prefix_caching=False,
              max_model_len=max(long_prompt, args.context) + new_tokens)
    rng = random.Random(0)
    max_token_id = min(10000, SHAPES[args.shape]["vocab_size"] - 1)

    def prompt(n: int) -> list[int]:
        return [rng.randint(0, max_token_id) for _ in range(n)]

    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new_tokens)
    for _ in range(args.decodes):
        llm.add_request(prompt(args.context), params)
    while llm.scheduler.waiting:  # every prompt prefilled: all decoding from here
        llm.step()
    print(f"{args.shape}: {args.decodes} sequences decoding at context ~{args.context}")
    print(f"  decode step only           {timed_steps(llm, STEPS):6.2f} ms")
    for tokens in args.prefill_tokens:
        llm.scheduler.prefill_budget = lambda num_decodes, tokens=tokens: tokens
        request = llm.add_request(prompt(long_prompt), params)
        before = mixed_replays(llm)
        ms = timed_steps(llm, STEPS)
        replays = mixed_replays(llm) - before
        print(f"  + {tokens:4d} prefill tokens    {ms:6.2f} ms   "
              f"({replays} of {STEPS + 2} steps on a mixed graph)")
        llm.abort_request(request)
    llm.close()


if __name__ == "__main__":
    main()
