"""Tensor-core kernel rates at the clock a microbenchmark sees and at the clock a training step runs at.

A training step keeps the GPU at its power limit, where the SM clock settles well below boost; a kernel timed
alone after an idle gap runs near boost. The cost model's ceilings must be the rates at the power limit, while most
published kernel tables (GEMM profiles, the FlashAttention papers, cuDNN frontend's benchmarks) are timed from idle.
This times the same kernels three ways on one GPU, so both can be read off one run (benchmarks/device_vs_model.py
sets the results beside the model's rates):

- burst: one call after an idle gap (the clock recovers between calls), the best of five;
- bench: after an idle gap, back-to-back calls as do_bench-style microbenchmarks run them (median);
- sustained: after a soak of dense GEMMs that brings the GPU to its power limit, back-to-back calls (median).

Kernels: a bf16 8192^3 GEMM, an FP8 (e4m3, per-tensor scales) 8192^3 GEMM through torch._scaled_mm, and causal
attention (32 heads, head dim 128, 16,384 tokens as 2 x 8K and 1 x 16K) forward and backward through PyTorch SDPA's
flash (FlashAttention-2) and cuDNN backends (`--seqs` for other lengths). SM clock, power and temperature are
sampled through NVML (its power reading averages over about a second, so a short bench window reads low).

`--suite gemm` times the GEMMs of Llama-3 8B and 70B layers instead (forward, input-gradient and weight-gradient
shapes, bf16 and FP8), `--suite grouped` MoE expert GEMMs launched per expert on 4 streams (TransformerEngine's
default grouped GEMM), `--suite sweep` GEMMs over the inner dimension and over size, `--suite mixed` the shallow
ones each right after a dense GEMM (the clock a training step gives them); these in the bench and sustained modes
only.

Needs a CUDA GPU: `python benchmarks/device_kernel_clocks.py [--suite gemm] --out results.json` (about 2 minutes).
Results of the runs so far are in benchmarks/RESULTS.md ("Kernel rates at the power-saturated clock").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Reading:
    kernel: str
    mode: str
    tflops: float
    ms: float
    sm_mhz: float
    watts: float
    celsius: float


class Sampler:
    """NVML samples (time, SM MHz, W, C) every 20 ms on a thread; the GPU's state over a window is their mean."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, float, float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n, h = self.nvml, self.handle
        while not self.stop.is_set():
            self.samples.append((time.perf_counter(), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                                 n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                                 n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)))
            time.sleep(0.02)

    def window(self, start: float, end: float) -> tuple[float, float, float]:
        inside = [s for s in list(self.samples) if start <= s[0] <= end] or list(self.samples)[-1:]
        return tuple(statistics.fmean(s[i] for s in inside) for i in (1, 2, 3))  # type: ignore[return-value]

    def power_limit_w(self) -> float:
        return self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000.0


def fp8_operands(torch, a, b):
    """a and b in e4m3 for torch._scaled_mm, which takes its second operand column-major."""
    return a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()


def kernels(torch, seqs: tuple[int, ...] = (8192, 16384)):
    """(name, FLOPs, callable) for each kernel; inputs random (zeros run faster than real data)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, bf16 = "cuda", torch.bfloat16
    out = []
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=bf16), torch.randn(n, n, device=dev, dtype=bf16)
    out.append(("gemm_bf16_8192", 2.0 * n ** 3, lambda: a @ b))
    try:
        a8, b8 = fp8_operands(torch, a, b)
        one = torch.ones((), device=dev, dtype=torch.float32)
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16)
        out.append(("gemm_fp8_8192", 2.0 * n ** 3, lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                                              out_dtype=bf16)))
    except Exception as exc:  # an FP8 GEMM this torch build lacks: report and go on
        print(f"fp8 gemm skipped: {exc}", file=sys.stderr)
    heads, dim = 32, 128
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        for batch, seq in ((16384 // s, s) for s in seqs):
            q, k, v = (torch.randn(batch, heads, seq, dim, device=dev, dtype=bf16, requires_grad=True)
                       for _ in range(3))
            fwd_flops = 4.0 * batch * heads * seq * seq * dim / 2  # causal: half the score matrix

            def forward(q=q, k=k, v=v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            try:
                o = forward()
                g = torch.randn_like(o)
                torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
            except Exception as exc:
                print(f"{label} attention {seq} skipped: {exc}", file=sys.stderr)
                continue
            out.append((f"attn_{label}_fwd_{seq}", fwd_flops, forward))
            # the backward alone: fresh gradients from the retained graph (no accumulation into .grad)
            out.append((f"attn_{label}_bwd_{seq}", 2.5 * fwd_flops,
                        lambda o=o, g=g, q=q, k=k, v=v: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)))
    return out


# (label, tokens, out features, in features) of the layers' linears: Llama-3 8B (hidden 4096, FFN 14336, 8 KV
# heads) unsharded at 16K tokens, and Llama-3 70B (hidden 8192, FFN 28672, 8 KV heads) at TP 8 and 8K tokens
LINEARS = (("8b_qkv", 16384, 6144, 4096), ("8b_out", 16384, 4096, 4096), ("8b_up_gate", 16384, 28672, 4096),
           ("8b_down", 16384, 4096, 14336), ("70b_tp8_qkv", 8192, 1280, 8192), ("70b_tp8_out", 8192, 8192, 1024),
           ("70b_tp8_up_gate", 8192, 7168, 8192), ("70b_tp8_down", 8192, 8192, 3584))


def gemm_kernels(torch, fast_accum: bool = False):
    """(name, FLOPs, callable): each linear's forward (tokens x out, depth in), input gradient (tokens x in, depth
    out) and weight gradient (out x in, depth tokens), bf16 and FP8 (per-tensor scales, _scaled_mm)."""
    dev, bf16 = "cuda", torch.bfloat16
    one = torch.ones((), device=dev, dtype=torch.float32)
    out: list = []
    for label, t, n_out, n_in in LINEARS:
        for pass_, (m, n, k) in (("fwd", (t, n_out, n_in)), ("dgrad", (t, n_in, n_out)), ("wgrad", (n_out, n_in, t))):
            a, b = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
            if not fast_accum:
                out.append((f"{label}_{pass_}_bf16", 2.0 * m * n * k, lambda a=a, b=b: a @ b))
            try:
                a8, b8 = fp8_operands(torch, a, b)
                torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16, use_fast_accum=fast_accum)
                out.append((f"{label}_{pass_}_fp8{'_fast' if fast_accum else ''}", 2.0 * m * n * k,
                            lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16,
                                                                  use_fast_accum=fast_accum)))
            except Exception as exc:
                print(f"fp8 {label} {pass_} skipped: {exc}", file=sys.stderr)
    return out


# (label, experts on the GPU, tokens per expert, hidden, expert FFN) of MoE layers: DeepSeek-V3 at EP 32 (8 of 256
# experts, top-8), Qwen3-235B-A22B at EP 8 (16 of 128) and Qwen3-30B-A3B at EP 8 (16 of 128), 4K tokens a GPU
EXPERTS = (("dsv3_ep32", 8, 4096, 7168, 2048), ("qwen3_235b_ep8", 16, 2048, 4096, 1536),
           ("qwen3_30b_ep8", 16, 2048, 2048, 768))


def grouped_kernels(torch, streams: int = 4):
    """(name, FLOPs, callable): each expert's GEMM launched in turn on `streams` CUDA streams, as
    TransformerEngine's default grouped GEMM runs them (transformer_engine/common/util/multi_stream.h: 4 compute
    streams), for the first (gate+up) and second expert linears forward and the first's weight gradient."""
    dev, bf16 = "cuda", torch.bfloat16
    pool = [torch.cuda.Stream() for _ in range(streams)]
    one = torch.ones((), device=dev, dtype=torch.float32)
    out: list = []
    for label, experts, tokens, hidden, ffn in EXPERTS:
        for pass_, (m, n, k) in (("fc1_fwd", (tokens, 2 * ffn, hidden)), ("fc2_fwd", (tokens, hidden, ffn)),
                                 ("fc1_wgrad", (2 * ffn, hidden, tokens))):
            a = [torch.randn(m, k, device=dev, dtype=bf16) for _ in range(experts)]
            b = [torch.randn(k, n, device=dev, dtype=bf16) for _ in range(experts)]
            pairs = [fp8_operands(torch, x, y) for x, y in zip(a, b, strict=True)]
            a8, b8 = [x for x, _ in pairs], [y for _, y in pairs]

            def run(fp8: bool, a=a, b=b, a8=a8, b8=b8):
                main = torch.cuda.current_stream()
                for s in pool:
                    s.wait_stream(main)
                for e in range(len(a)):
                    with torch.cuda.stream(pool[e % len(pool)]):
                        if fp8:
                            torch._scaled_mm(a8[e], b8[e], scale_a=one, scale_b=one, out_dtype=bf16)
                        else:
                            a[e] @ b[e]
                for s in pool:
                    main.wait_stream(s)

            flops = 2.0 * m * n * k * experts
            out.append((f"{label}_{pass_}_bf16", flops, lambda run=run: run(False)))
            out.append((f"{label}_{pass_}_fp8", flops, lambda run=run: run(True)))
    return out


# GEMM shapes that isolate the model's two shape terms: the inner dimension K at M = N = 8192 (kernels.k_depth_factor)
# and the size of the GEMM (the FLOP saturation, gemm_half_flops)
SWEEP = tuple(("k", 8192, 8192, k) for k in (256, 512, 1024, 2048, 4096, 8192)) + tuple(
    ("size", m, n, k) for m, n, k in ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (512, 8192, 8192),
                                      (1024, 8192, 8192), (2048, 8192, 8192)))


def sweep_kernels(torch):
    """(name, FLOPs, callable) for SWEEP in bf16 and FP8 (per-tensor scales, split accumulation)."""
    dev, bf16 = "cuda", torch.bfloat16
    one = torch.ones((), device=dev, dtype=torch.float32)
    out: list = []
    for what, m, n, k in SWEEP:
        a, b = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
        a8, b8 = fp8_operands(torch, a, b)
        out.append((f"{what}_{m}x{n}x{k}_bf16", 2.0 * m * n * k, lambda a=a, b=b: a @ b))
        out.append((f"{what}_{m}x{n}x{k}_fp8", 2.0 * m * n * k,
                    lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16)))
    return out


def mixed_kernels(torch):
    """(name, FLOPs, callable) for the K sweep's shallow GEMMs, each call preceded by a dense 8192^3 BF16 GEMM that it
    does not time: the clock a shallow GEMM gets inside a step whose power the dense GEMMs set (alone, a shallow GEMM
    draws less power and the clock rises for it)."""
    dev, bf16 = "cuda", torch.bfloat16
    one = torch.ones((), device=dev, dtype=torch.float32)
    big_a, big_b = (torch.randn(8192, 8192, device=dev, dtype=bf16) for _ in range(2))
    out: list = []
    for _, m, n, k in SWEEP[:4]:
        a, b = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
        a8, b8 = fp8_operands(torch, a, b)
        out.append((f"mixed_k_{m}x{n}x{k}_bf16", 2.0 * m * n * k, (lambda: big_a @ big_b, lambda a=a, b=b: a @ b)))
        out.append((f"mixed_k_{m}x{n}x{k}_fp8", 2.0 * m * n * k,
                    (lambda: big_a @ big_b,
                     lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16))))
    return out


def timed_after(torch, pair, calls: int) -> list[float]:
    """Milliseconds of the second kernel of `pair`, each call right after an untimed run of the first."""
    before, fn = pair
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def timed(torch, fn, calls: int) -> list[float]:
    """Milliseconds of each of `calls` back-to-back calls (events around each, one sync at the end)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def run_for(torch, fn, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            for f in (fn if isinstance(fn, tuple) else (fn,)):
                f()
        torch.cuda.synchronize()


def measure(torch, sampler: Sampler, mode: str, name: str, flops: float, fn, idle: float = 3.0,
            settle: float = 1.5) -> Reading:
    if mode == "burst":  # one call after an idle gap, five times: the best, as a boost-clock ceiling is read
        times, windows = [], []
        for _ in range(5):
            time.sleep(0.6)
            t0 = time.perf_counter()
            times += timed_after(torch, fn, 1) if isinstance(fn, tuple) else timed(torch, fn, 1)
            windows.append((t0, time.perf_counter()))
        ms = min(times)
        state = sampler.window(windows[0][0], windows[-1][1])
    else:
        if mode == "bench":  # idle, then a short warm-up and back-to-back timed calls (do_bench's way)
            time.sleep(idle)
            run_for(torch, fn, 0.025)
        else:  # sustained: already soaked; run on so the clock settles for this kernel
            run_for(torch, fn, settle)
        t0 = time.perf_counter()
        ms = statistics.median(timed_after(torch, fn, 20) if isinstance(fn, tuple) else timed(torch, fn, 20))
        state = sampler.window(t0, time.perf_counter())
    return Reading(name, mode, flops / (ms * 1e-3) / 1e12, ms, *state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the readings here as JSON")
    parser.add_argument("--soak", type=float, default=20.0, help="seconds of dense GEMMs before the sustained pass")
    parser.add_argument("--suite", choices=("clocks", "gemm", "grouped", "sweep", "mixed"), default="clocks",
                        help="clocks: a GEMM and attention three ways; gemm: the training GEMM shapes; grouped: MoE "
                        "expert GEMMs on 4 streams; sweep: GEMMs over K and over size; mixed: shallow GEMMs each "
                        "after a dense one")
    parser.add_argument("--fast-accum", action="store_true",
                        help="gemm suite: FP8 only, with fast accumulation (TransformerEngine's forward GEMMs)")
    parser.add_argument("--seqs", default="8192,16384", help="clocks suite: attention sequence lengths (16K tokens "
                        "a call)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of burst,bench,sustained")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("error: needs PyTorch with CUDA (pip install torch) on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible; run this on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    sampler = Sampler()
    seqs = tuple(int(x) for x in args.seqs.split(","))
    builders = {"clocks": lambda: kernels(torch, seqs), "gemm": lambda: gemm_kernels(torch, args.fast_accum),
                "grouped": lambda: grouped_kernels(torch), "sweep": lambda: sweep_kernels(torch),
                "mixed": lambda: mixed_kernels(torch)}
    cases = builders[args.suite]()
    for _, _, fn in cases:  # compile, autotune and allocate outside every timing
        timed_after(torch, fn, 2) if isinstance(fn, tuple) else timed(torch, fn, 2)
    modes = ("burst", "bench", "sustained") if args.suite == "clocks" else ("bench", "sustained")
    if args.modes:
        modes = tuple(m for m in modes if m in args.modes.split(","))
    idle, settle = (3.0, 1.5) if args.suite == "clocks" else (1.0, 0.5)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    soak = lambda: a @ b  # noqa: E731 (dense bf16 GEMMs draw the most power)
    readings = []
    for mode in modes:
        if mode == "sustained":
            run_for(torch, soak, args.soak)
            print(f"soak {args.soak:.0f} s: SM {sampler.window(time.perf_counter() - 2, time.perf_counter())[0]:.0f}"
                  " MHz over its last 2 s", flush=True)
        for name, flops, fn in cases:
            r = measure(torch, sampler, mode, name, flops, fn, idle, settle)
            readings.append(r)
            print(f"{r.mode:9s} {r.kernel:26s} {r.tflops:7.1f} TFLOP/s {r.ms:8.3f} ms  SM {r.sm_mhz:6.0f} MHz "
                  f"{r.watts:5.0f} W {r.celsius:3.0f} C", flush=True)
    sampler.stop.set()
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "power_limit_w": sampler.power_limit_w(),
            "readings": [asdict(r) for r in readings]}
    print(f"\n{'kernel':26s}" + "".join(f"{m:>10s}" for m in modes) + "  sustained/bench")
    for name, _, _ in cases:
        by = {r.mode: r.tflops for r in readings if r.kernel == name}
        ratio = by["sustained"] / by["bench"] if "sustained" in by and "bench" in by else float("nan")
        print(f"{name:26s}" + "".join(f"{by[m]:10.1f}" for m in modes) + f"{ratio:17.3f}")
    print(json.dumps({k: v for k, v in info.items() if k != "readings"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
