"""tools/bench_splitk.py's chain (every product of a model's layers, norms and activation fused) on
kernels/gemv.py's tensor-core kernel, whose weight tiles come by TMA, against the GEMV at each row
count (README, "Decode step by batch size"). Measured (H200, Qwen3-8B; from a copy of the kernel
here before it went into gemv.py, branch tma-tc): 4.108 / 4.147 ms at 1 / 4 rows, against 4.305 /
4.300 for the same kernel with per-thread weight loads (tools/bench_tc.py) and the GEMV's 3.740
at one row.
    PYTHONPATH=.:tools python tools/bench_tma.py --check --shape qwen3-8b --rows 1,4 --configs 64/32768/4
config: weight rows a tile / bytes a tile / tiles in flight (gemv.py's TC_TILE_ROWS, TC_TILE_BYTES, TC_STAGES)"""
from bench_splitk import main
from nanograph.kernels import gemv as gemv_module

CONFIG = {}


def parse_config(text: str) -> dict:
    return dict(zip(("TC_TILE_ROWS", "TC_TILE_BYTES", "TC_STAGES"), map(int, text.split("/"))))


def tensor_cores(x, weight, bias=None, silu_and_mul=False, norm_weight=None, eps=0.0, residual=None,
                 residual_out=None):
    for name, value in CONFIG.items():
        setattr(gemv_module, name, value)
    return gemv_module.gemv(x, weight, bias, silu_and_mul, norm_weight, eps, residual, residual_out,
                            tensor_cores=True)


if __name__ == "__main__":
    main(tensor_cores, CONFIG, parse_config, "64/32768/4")
