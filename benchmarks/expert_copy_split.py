"""One copy per expert vs one copy per array: pinned host -> GPU rate.

Layout question of the INT4 cache (runtime/cache/src/layout.rs): an a3b expert
block is 2,433,024 bytes holding four arrays (w13_q, w13_s, w2_q, w2_s). This
copies 512 experts from pinned host memory, once as one copy per expert and
once as four copies per expert (the array sizes of the real layout), and
reports GB/s for each plus a 1 GiB single copy for reference.
Run on the GPU machine: python3 benchmarks/expert_copy_split.py
"""
import torch

STRIDE = 2433024
PARTS = [1572864, 49152, 786432, 24576]  # w13_q, w13_s, w2_q, w2_s (a3b geometry)
N = 512


def timed(fn, reps=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    best = None
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        best = ms if best is None else min(best, ms)
    return best / 1e3


host = torch.empty(N * STRIDE, dtype=torch.uint8).pin_memory()
dev = torch.empty(N * STRIDE, dtype=torch.uint8, device="cuda")
offs = [0]
for p in PARTS[:-1]:
    offs.append(offs[-1] + ((p + 255) // 256) * 256)


def one_per_expert():
    for e in range(N):
        o = e * STRIDE
        dev[o:o + STRIDE].copy_(host[o:o + STRIDE], non_blocking=True)


def four_per_expert():
    for e in range(N):
        for off, size in zip(offs, PARTS):
            o = e * STRIDE + off
            dev[o:o + size].copy_(host[o:o + size], non_blocking=True)


big_h = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
big_d = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
t1 = timed(one_per_expert)
t4 = timed(four_per_expert)
tb = timed(lambda: big_d.copy_(big_h, non_blocking=True))
total = N * STRIDE
print(f"one copy per expert : {total / t1 / 1e9:.1f} GB/s ({t1 / N * 1e6:.1f} us/expert)")
print(f"four copies/expert  : {total / t4 / 1e9:.1f} GB/s ({t4 / N * 1e6:.1f} us/expert)")
print(f"1 GiB single copy   : {(1 << 30) / tb / 1e9:.1f} GB/s")
