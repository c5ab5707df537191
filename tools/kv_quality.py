"""What an FP8 KV cache costs in quality, on the bundled demo model.

    python -m tools.kv_quality [--device cuda] [--files 24] [--tokens 300] [--new 32]

Held-out Python (the first characters of this package's own files, which the demo model never
saw) through `kv_cache_dtype="auto"` and `"fp8"` in turn: the mean negative log-likelihood of
the text's tokens (prompt logprobs, each token given the ones before it), and the greedy
completions of the same prompts: how many are identical, and how many tokens they share before
the first difference. On the CPU the torch backend emulates the e4m3 cache; on CUDA the Triton
kernels run it.
"""
import argparse
import glob

from nanograph import LLM, SamplingParams

DEMO_MODEL = "nanograph/pretrained/pycoder"


def measure(dtype: str, texts: list[str], args) -> tuple[float, list[list[int]]]:
    """(mean NLL of the texts' tokens, greedy completions) under kv_cache_dtype `dtype`."""
    with LLM(DEMO_MODEL, kv_cache_dtype=dtype, device=args.device) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text)[:args.tokens] for text in texts]
        params = SamplingParams(temperature=0, max_tokens=args.new, prompt_logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    nll = [-entry[token] for prompt, out in zip(prompts, outs)
           for token, entry in zip(prompt[1:], out["prompt_logprobs"][1:])]
    return sum(nll) / len(nll), [out["token_ids"] for out in outs]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=300, help="prompt tokens per file")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens per completion")
    args = parser.parse_args()
    files = sorted(glob.glob("nanograph/**/*.py", recursive=True))[:args.files]
    texts = [open(path).read()[:4 * args.tokens] for path in files]
    (auto_nll, auto_out), (fp8_nll, fp8_out) = (measure(d, texts, args) for d in ("auto", "fp8"))
    prefixes = [shared_prefix(a, f) for a, f in zip(auto_out, fp8_out)]
    print(f"mean NLL: auto {auto_nll:.4f}, fp8 {fp8_nll:.4f} ({(fp8_nll / auto_nll - 1):+.2%})")
    print(f"greedy completions of {args.new} tokens: {sum(a == f for a, f in zip(auto_out, fp8_out))}"
          f" of {len(files)} identical; shared tokens before the first difference: mean "
          f"{sum(prefixes) / len(prefixes):.1f}")
