"""What a mixed step costs next to a decode step: the step time by the prefill tokens beside it.

    python -m tools.mixed_step_cost [--shape qwen3-0.6b] [--decodes 64] [--context 1000]
    python -m tools.mixed_step_cost --shape tiny --device cpu --decodes 4 --context 32 \
        --prefill-tokens 4,8 --steps 4                         # a smoke run on a CPU

The measurement of bench.py --mixed-step-cost (benchmarks/mixed_step_cost.py says what each row
holds and how its steps are checked), with its sizes on the command line.
"""
import argparse
import tempfile

from benchmarks.mixed_step_cost import Scale, measure_mixed_steps, print_rows
from benchmarks.shapes import SHAPES, write_model_dir
from nanograph import LLM


def main():
    ints = lambda text: tuple(int(n) for n in text.split(","))  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--prefill-tokens", default=(16, 64, 128, 192, 256, 512, 1024), type=ints)
    p.add_argument("--steps", type=int, default=16, help="timed steps a row")
    args = p.parse_args()
    scale = Scale(args.decodes, args.context, args.prefill_tokens, args.steps)
    path = write_model_dir(args.shape, tempfile.mkdtemp())
    with LLM(path, load_format="dummy", device=args.device, **scale.engine_knobs()) as llm:
        max_token_id = min(10000, SHAPES[args.shape]["vocab_size"] - 1)
        rows = measure_mixed_steps(llm, scale, max_token_id, judge=args.device != "cpu")
        print_rows(rows, scale, llm.config)


if __name__ == "__main__":
    main()
