"""bf16 against float32 matmul throughput on this machine, side by side, beside the library's short probe, and the
precision trl-topr picks for it.

    python benchmarks/precision.py           # 1024 x 1024 matmuls, 2 s per precision
    python benchmarks/precision.py --quick   # 64 x 64, a fraction of a second (tests/test_benchmarks.py)

Writes `results.json` and `table.md`, with their provenance, to --out (default benchmarks/results/precision).

The two precisions alternate `--reps` times (medians reported), on the CPU or on the GPU that training would use. On a
CPU, the rule ([`trl_topr.precision.bf16_is_faster`]) decides from a probe of about a second, run once and cached
([`trl_topr.precision.measure_cpu_bf16_speedup`]): this command runs the probe afresh (not from the cache) beside the
long measurement, so that the two can be compared on a machine.
"""

import argparse
import statistics
import time
from pathlib import Path

from provenance import ROOT, save


def gflops(dtype, size: int, seconds: float, device: str) -> float:
    """Matmul GFLOP/s of `size` x `size` matrices of `dtype`, timed over about `seconds`."""
    import torch

    a, b = torch.randn(size, size, device=device).to(dtype), torch.randn(size, size, device=device).to(dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - start) / 1e9


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small matrices, short timings (smoke run)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="results folder (default: benchmarks/results/precision, outputs/ with --quick)")
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / ("outputs/precision-quick" if args.quick else "benchmarks/results/precision"))
    started = time.time()

    import torch

    from trl_topr.precision import (  # internal: the probe this benchmark measures
        BF16_SPEEDUP_NEEDED,
        bf16_is_faster,
        device_type,
        measure_cpu_bf16_speedup,
    )

    device = device_type()
    size, seconds = (64, 0.05) if args.quick else (1024, 2.0)
    rates = {torch.float32: [], torch.bfloat16: []}
    for _ in range(args.reps):
        for dtype in rates:
            rates[dtype].append(gflops(dtype, size, seconds, device))
    fp32, bf16 = statistics.median(rates[torch.float32]), statistics.median(rates[torch.bfloat16])
    cpu = (
        f"AMX {torch.cpu._is_amx_tile_supported()}, AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}, "
        f"torch ISA {torch.backends.cpu.get_cpu_capability()}"
    )
    probe = measure_cpu_bf16_speedup() if device == "cpu" else None
    picked = (
        ("bf16" if probe >= BF16_SPEEDUP_NEEDED else "fp32")
        if probe is not None
        else ("bf16" if bf16_is_faster(device) else "fp32")
    )
    table = "\n".join(
        [
            "| device | fp32 GFLOP/s | bf16 GFLOP/s | bf16/fp32 | the probe's bf16/fp32 | trl-topr picks |",
            "|---|---|---|---|---|---|",
            f"| {device} | {fp32:.1f} | {bf16:.1f} | {bf16 / fp32:.2f} | "
            f"{'-' if probe is None else f'{probe:.2f}'} | {picked} |",
        ]
    )
    title = f"{size} x {size} matmuls, median of {args.reps} alternating reps; CPU: {cpu}"
    results = {
        "device": device,
        "size": size,
        "reps": args.reps,
        "fp32_gflops": fp32,
        "bf16_gflops": bf16,
        "bf16_over_fp32": bf16 / fp32,
        "probe_bf16_over_fp32": probe,
        "picks": picked,
        "cpu": cpu,
        "all_gflops": {"fp32": rates[torch.float32], "bf16": rates[torch.bfloat16]},
    }
    save(
        out,
        {"results.json": results, "table.md": f"{title}\n\n{table}\n"},
        script=__file__,
        argv=argv,
        started=started,
    )
    print(f"{title}\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
