"""Probe: how many exponentials a second the SFU (MUFU) gives, per PTX form: ex2.approx.ftz.f32 against
the packed ex2.approx.f16x2 and ex2.approx.ftz.bf16x2 (sm_90).

Why: the FP8 classifier's rows make two ex2 a logit (the row sum, then the dlogits) and on an H200 the
kernel sits at ~70-75% of a copy's bandwidth, not 90%; if a packed form gave two results a MUFU slot,
the dlogits' half could take half the SFU time (tools/notes/fp8.md, sixtieth session).
Each thread runs CHAINS independent ex2 chains (y = ex2(y): the values overflow to inf and stay there,
which the SFU's rate does not care about) over ITERS steps; results a second count both halves of a
packed pair. Run (GPU):  PYTHONPATH=. python3 tools/probes/mufu_rate.py
"""
import cupy as cp

CHAINS, ITERS, THREADS = 8, 4096, 256

SRC = r"""
#define CHAINS %(chains)d
extern "C" __global__ void ex2_f32(float* out, int iters) {
    float y[CHAINS];
    #pragma unroll
    for (int c = 0; c < CHAINS; c++) y[c] = -1.0f - 0.01f * (threadIdx.x + c);
    for (int i = 0; i < iters; i++)
        #pragma unroll
        for (int c = 0; c < CHAINS; c++) asm volatile("ex2.approx.ftz.f32 %%0, %%0;" : "+f"(y[c]));
    float s = 0.0f;
    #pragma unroll
    for (int c = 0; c < CHAINS; c++) s += y[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
// a packed pair's kernel: y = INSTR(y) on CHAINS u32 pairs, starting near -1.0 (INIT)
#define PACKED(NAME, INIT, INSTR)                                                        \
extern "C" __global__ void NAME(unsigned* out, int iters) {                              \
    unsigned y[CHAINS];                                                                  \
    _Pragma("unroll") for (int c = 0; c < CHAINS; c++) y[c] = INIT ^ (threadIdx.x + c);  \
    for (int i = 0; i < iters; i++)                                                      \
        _Pragma("unroll") for (int c = 0; c < CHAINS; c++) asm volatile(INSTR " %%0, %%0;" : "+r"(y[c])); \
    unsigned s = 0u;                                                                     \
    _Pragma("unroll") for (int c = 0; c < CHAINS; c++) s ^= y[c];                       \
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;                                      \
}
PACKED(ex2_f16x2, 0xbc00bc00u, "ex2.approx.f16x2")
PACKED(ex2_bf16x2, 0xbf80bf80u, "ex2.approx.ftz.bf16x2")
""" % {"chains": CHAINS}


def main():
    props = cp.cuda.runtime.getDeviceProperties(0)
    sms = props["multiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
    blocks = sms * 8
    out = cp.empty(blocks * THREADS, cp.uint32)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    print(f"{props['name'].decode()}: {sms} SMs, {blocks} x {THREADS} threads, {CHAINS} chains x {ITERS} steps")
    for name, per_op in (("ex2_f32", 1), ("ex2_f16x2", 2), ("ex2_bf16x2", 2)):
        k = mod.get_function(name)
        k((blocks,), (THREADS,), (out, cp.int32(ITERS)))            # warm-up (and the clock up)
        best = float("inf")
        for _ in range(5):
            start.record()
            k((blocks,), (THREADS,), (out, cp.int32(ITERS)))
            end.record()
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end))
        ops = blocks * THREADS * CHAINS * ITERS
        print(f"{name:11s} {best:8.3f} ms  {ops / best / 1e9:7.3f} T instructions/s  "
              f"{per_op * ops / best / 1e9:7.3f} T results/s  {ops / best / 1e6 / sms:6.1f} G instr/s an SM")


if __name__ == "__main__":
    main()
