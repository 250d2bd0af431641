"""Probe: how fast can a GPU read dout's rows in the order the encoder's dwte kernel reads them?

Issue 3's dwte kernel (sorted by token, 64 rows per block) stalls at ~57% of copy bandwidth and a
deeper cp.async ring (the deleted encoder backward v5, tools/notes/kernels_perf.md) did not help, so
the question is the access pattern itself. This times one simple kernel -- each block of 96 threads
sums 64 rows of a (65536, 768) bf16 array, one 16-byte pack per thread per row, 8 loads in flight --
over three row orders:
  sequential   rows 0, 1, 2, ...            (the dwpe / copy pattern)
  token-sorted rows by (token, position)    (the dwte pattern, Zipf(1.2) tokens as in the bench)
  random       a random permutation         (the worst case for DRAM pages)
and prints GB/s against the copy figure. Run on the device:  PYTHONPATH=. python3 tools/probes/encoder_gather.py
Under ncu (what the dwte kernel itself does):  ... --kernel-name regex:dwte_kernel_v3 python3 tools/probes/encoder_gather.py --dwte
(the production dwte: encoder.counting_sort_keys, then encoder.launch_dwte)
"""
import sys

import cupy as cp
import numpy as np

from gpucore.bench import copy_bandwidth_gbps, time_device_ms
from gpucore.dtypes import bfloat16

SRC = r"""
extern "C" __global__ void __launch_bounds__(96) gather_rows(float* out, const uint4* src, const int* order, int rows) {
    const int t = threadIdx.x, r0 = blockIdx.x * 64;
    float acc = 0.f;
    #pragma unroll 8
    for (int i = 0; i < 64; i++) {
        const int r = r0 + i;
        if (r < rows) {
            const uint4 v = src[(size_t)order[r] * 96 + t];
            acc += __int_as_float(v.x & 0xffff0000u) + __int_as_float(v.w << 16);
        }
    }
    out[blockIdx.x * 96 + t] = acc;
}
"""


def main():
    N, C, V = 65536, 768, 50257
    rng = np.random.default_rng(0)
    tokens = ((rng.zipf(1.2, size=N) - 1) % V).astype(np.int32)   # the encoder bench's tokens
    orders = {"sequential": np.arange(N, dtype=np.int32),
              "token-sorted": np.argsort(tokens, kind="stable").astype(np.int32),
              "random": rng.permutation(N).astype(np.int32)}
    host = rng.standard_normal((N, C)).astype(np.float32).astype(bfloat16)
    src = cp.asarray(host.view(np.uint16))                            # bf16 bits, (N, C)
    kern = cp.RawModule(code=SRC).get_function("gather_rows")
    out = cp.empty((N // 64) * 96, cp.float32)
    bw = copy_bandwidth_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s; {N} rows x {C} bf16 = {N * C * 2 / 1e6:.1f} MB read")
    for name, order in orders.items():
        o = cp.asarray(order)
        ms = time_device_ms(lambda: kern((N // 64,), (96,), (out, src, o, np.int32(N))))
        gbs = (N * C * 2 + 4 * N) / ms / 1e6
        print(f"gather {name:13s} {ms * 1e3:7.1f} us  {gbs:7.0f} GB/s  {100 * gbs / bw:5.1f}% of copy")
    if "--dwte" in sys.argv:                                            # the real kernel, for ncu
        import gpucore  # noqa: F401
        from gpucore.ops import encoder as enc
        toks = cp.asarray(tokens.reshape(64, 1024))
        dout = cp.asarray(host.reshape(64, 1024, C))
        dwte = cp.zeros((50304, C), bfloat16)
        keys, bits = enc.counting_sort_keys(toks, 50304)
        enc.launch_dwte(dwte, dout, keys, bits)
        cp.cuda.get_current_stream().synchronize()
        print("dwte (v3/v4 kernels) launched once")


if __name__ == "__main__":
    main()
