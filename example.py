"""Offline generation with nanograph.

    python example.py                      # the bundled demo model: completes Python code, offline
    python example.py --model Qwen/Qwen3-0.6B --prompt "Hello"   # any HF checkpoint (dir or hub id)

The demo model (nanograph/pretrained/pycoder, 8.2M parameters) is small: it writes plausible
Python, not correct Python. What `python example.py --temperature 0` printed on a CPU (float32)
for the second prompt (its first 8 lines):

    class LRUCache:
        def __init__(self, capacity):
            self.capacity = capacity

        def __repr__(self):
            return "LRUCache()"

        def __hash__(self):
            return hash(self.capacity)
"""
import argparse
import logging
from pathlib import Path

import nanograph
from nanograph import LLM, SamplingParams

DEMO_MODEL = Path(nanograph.__file__).parent / "pretrained" / "pycoder"
DEMO_PROMPTS = [
    "def parse_header(line):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL), help="HF-format directory or hub id")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few code prompts")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="per-request seed: the same output every run")
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    llm = LLM(args.model, device=args.device, enforce_eager=args.enforce_eager, max_model_len=1024)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    prompts = args.prompt or DEMO_PROMPTS
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        print(f"\n=== prompt\n{prompt}\n=== completion\n{out['text']}")


if __name__ == "__main__":
    main()
