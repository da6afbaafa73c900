"""CPU optimizer step throughput against the machine's memory bandwidth, measured in the same run.

    python scripts/bench/bench_kernels.py                    # 200M parameters, all cores
    python scripts/bench/bench_kernels.py --params 500e6     # the GPU machine's figure

Rows: (a) torch's fused CPU AdamW on fp32 gradients plus a separate bf16 cast of the parameters (the best
pipeline with stock torch), (b) DeepSpeed's CPU Adam when installed, (c) ours, one pass with bf16 gradients in
and the bf16 copy out, with fp32 moments and with bf16 ones (`optimizer_state_dtype="bf16"`: 20 B/param). The floor
is 28 B/param (fp32 p, m, v read and written; bf16 grad in, bf16 copy out) at the best bandwidth our STREAM-style
probe measures; "of floor" is against it for every row (bf16 moments can pass 100%). Prints a table and writes JSON
(results.write_result: `--out`, or bench/results/<date>_<machine>_kernels.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_zoff import ops
from zoffbench.results import write_result

FUSED_BYTES = 28  # p, m, v: 12 read + 12 written; bf16 grad 2 read; bf16 copy 2 written
BF16_MOMENTS_BYTES = 20  # p 4, m and v 2 + 2: 8 read + 8 written; grad and copy as above


def timed(fn, reps: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=200e6)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n, threads = int(args.params), args.threads
    torch.set_num_threads(threads)
    isa = ops.selected_isa()
    print(f"{n / 1e6:.0f}M params, {threads} threads, ISA {isa} (available: {ops.available_isas()})", flush=True)

    stream = ops.stream_probe(nbytes=max(2 << 30, n * 4), threads=threads)
    best_bw = max(stream.values())
    print("memory probe (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in stream.items()), flush=True)

    p = torch.randn(n) * 0.02
    m, v = torch.zeros(n), torch.zeros(n)
    g32 = torch.randn(n) * 1e-3
    g16 = g32.to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = torch.tensor(1.0)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    rows = []

    def torch_fused():
        torch._fused_adamw_([p], [g32], [m], [v], [], [step], amsgrad=False, maximize=False, grad_scale=None,
                            found_inf=None, **hp)
        out.copy_(p)

    rows.append(("torch fused AdamW fp32 grads + bf16 cast", timed(torch_fused, args.reps), 34))

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # not installed, or its JIT build failed
        print(f"DeepSpeed CPU Adam: not available ({type(err).__name__}: {str(err)[:120]})")
    else:
        param = torch.nn.Parameter(p.clone())
        param.grad = g32.clone()
        ds = DeepSpeedCPUAdam([param], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                              weight_decay=hp["weight_decay"], adamw_mode=True)
        rows.append(("DeepSpeed CPU Adam fp32 grads (no copy out)", timed(ds.step, args.reps), 28))
        del param, ds

    spare = [torch.zeros(n) for _ in range(3)]  # the engine's speculative updates write the new state here
    moments16 = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
    spare16 = [torch.zeros(n)] + [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]

    def ours(into=None, stream=True, moments=(m, v)):
        def run():
            ops.adam_step(p, g16, *moments, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                          weight_decay=hp["weight_decay"], step=1, decoupled=True, out=out, into=into,
                          stream=stream, threads=threads)
        return run

    # streamed: the bf16 copy (and the new state, updating into the spare) skips the read for ownership
    rows.append((f"zoff AdamW bf16 grads + bf16 out ({isa})", timed(ours(), args.reps), FUSED_BYTES))
    rows.append(("  same, cached stores", timed(ours(stream=False), args.reps), FUSED_BYTES))
    rows.append(("  into spare state (overlap), streamed", timed(ours(into=spare), args.reps), FUSED_BYTES))
    rows.append(("  into spare state (overlap), cached", timed(ours(into=spare, stream=False), args.reps),
                 FUSED_BYTES))
    rows.append(("  bf16 moments, in place", timed(ours(moments=moments16), args.reps), BF16_MOMENTS_BYTES))
    rows.append(("  bf16 moments, into spare state, streamed", timed(ours(into=spare16, moments=moments16), args.reps),
                 BF16_MOMENTS_BYTES))

    floor_s = n * FUSED_BYTES / (best_bw * 1e9)
    base = rows[0][1]
    print(f"\n{'kernel':<48} {'ns/param':>9} {'GB/s':>7} {'vs (a)':>7} {'of floor':>9}")
    results = []
    for name, seconds, nbytes in rows:
        results.append({"name": name, "seconds": seconds, "ns_per_param": seconds / n * 1e9,
                        "effective_gb_s": n * nbytes / seconds / 1e9, "speedup_vs_torch": base / seconds,
                        "fraction_of_floor": floor_s / seconds})
        r = results[-1]
        print(f"{name:<48} {r['ns_per_param']:>9.3f} {r['effective_gb_s']:>7.1f} {r['speedup_vs_torch']:>6.2f}x"
              f" {r['fraction_of_floor']:>8.0%}")
    print(f"{'DRAM floor (28 B/param at ' + f'{best_bw:.0f} GB/s)':<48} {floor_s / n * 1e9:>9.3f}")
    record = {"params": n, "threads": threads, "isa": isa, "stream_gb_s": stream,
              "floor_ns_per_param": floor_s / n * 1e9, "rows": results}
    print(f"wrote {write_result(record, 'kernels', args.out)}")


if __name__ == "__main__":
    main()
