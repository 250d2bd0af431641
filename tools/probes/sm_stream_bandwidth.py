"""Probe: how fast can k multiprocessors (one block each) stream a 400 MB bf16 array from DRAM?

The question behind the removed dbias "overlap" experiment (tools/probes/dbias_overlap.py in commit d773fff; tools/notes/restructure.md): a column sum running
on a few SMs beside the GEMMs must pull ~500 GB/s from ~8 SMs. Variants, each a 512-thread
block per SM (a 160 KB shared-memory request keeps it alone there):
  loads     16-byte ld.global, BATCH per thread in flight, XOR-folded (no float math)
  loads+sum the same, each bf16 converted and summed in float32 (the dbias kernel's work)
  bulk      cp.async.bulk (the TMA's 1-D copy) of STAGE bytes into a ring of smem stages,
            mbarrier-completed; threads XOR-fold each stage from smem
  bulk+sum  the same with the float32 sums
Run:  PYTHONPATH=. python3 tools/probes/sm_stream_bandwidth.py
"""
import cupy as cp

from gpucore.bench import time_interleaved

SRC = r'''
#define THREADS 512
#define BATCH 16
#define STAGE (24 * 1024)
#define STAGES 6

template <bool SUM>
__device__ void fold(const uint4& q, unsigned& x, float* acc) {
    if (SUM) {
        const unsigned w[4] = {q.x, q.y, q.z, q.w};
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[2 * i] += __uint_as_float(w[i] << 16);
            acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
        x ^= q.x ^ q.y ^ q.z ^ q.w;
    }
}

template <bool SUM>
__device__ void loads(const uint4* src, size_t n16, unsigned* out) {
    const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
    const size_t b0 = blockIdx.x * per, b1 = min(n16, b0 + per);
    unsigned x = 0; float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t i = b0 + threadIdx.x; i < b1; i += (size_t)THREADS * BATCH) {
        uint4 q[BATCH];
        #pragma unroll
        for (int u = 0; u < BATCH; u++) {
            const size_t j = i + (size_t)u * THREADS;
            if (j < b1) q[u] = __ldcs(src + j); else q[u] = make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int u = 0; u < BATCH; u++) fold<SUM>(q[u], x, acc);
    }
    for (int i = 0; i < 8; i++) x ^= __float_as_uint(acc[i]);
    out[blockIdx.x * THREADS + threadIdx.x] = x;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

template <bool SUM>
__device__ void bulk(const char* src, size_t nbytes, unsigned* out) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) unsigned long long bars[STAGES];
    const size_t per = ((nbytes + gridDim.x - 1) / gridDim.x + STAGE - 1) / STAGE * STAGE;
    const size_t b0 = blockIdx.x * per, b1 = min(nbytes, b0 + per);
    const int n_st = b1 > b0 ? (int)((b1 - b0 + STAGE - 1) / STAGE) : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    auto issue = [&](int st) {
        const int s = st % STAGES;
        const size_t off = b0 + (size_t)st * STAGE;
        const unsigned bytes = (unsigned)min((size_t)STAGE, b1 - off);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(smem_addr(&bars[s])), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(ring + s * STAGE)), "l"(src + off), "r"(bytes), "r"(smem_addr(&bars[s]))
                     : "memory");
    };
    if (threadIdx.x == 0)
        for (int st = 0; st < STAGES && st < n_st; st++) issue(st);
    unsigned x = 0; float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int st = 0; st < n_st; st++) {
        const int s = st % STAGES;
        const unsigned parity = (st / STAGES) & 1;
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(smem_addr(&bars[s])), "r"(parity) : "memory");
        const uint4* q = reinterpret_cast<const uint4*>(ring + s * STAGE);
        const int n16 = (int)(min((size_t)STAGE, b1 - (b0 + (size_t)st * STAGE)) / 16);
        for (int i = threadIdx.x; i < n16; i += THREADS) fold<SUM>(q[i], x, acc);
        __syncthreads();                        // every thread is done with stage s
        if (threadIdx.x == 0 && st + STAGES < n_st) issue(st + STAGES);
    }
    for (int i = 0; i < 8; i++) x ^= __float_as_uint(acc[i]);
    out[blockIdx.x * THREADS + threadIdx.x] = x;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) loads_k(const uint4* s, size_t n, unsigned* o) { loads<false>(s, n, o); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) loads_sum_k(const uint4* s, size_t n, unsigned* o) { loads<true>(s, n, o); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) bulk_k(const char* s, size_t n, unsigned* o) { bulk<false>(s, n, o); }
extern "C" __global__ void __launch_bounds__(THREADS, 1) bulk_sum_k(const char* s, size_t n, unsigned* o) { bulk<true>(s, n, o); }
'''
STAGE, STAGES, THREADS = 24 * 1024, 6, 512
mod = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
nbytes = 65536 * 3072 * 2
src = cp.random.default_rng(0).integers(0, 2**31, nbytes // 4, dtype=cp.int32)
out = cp.empty(200 * THREADS, cp.uint32)
ring = STAGE * STAGES
fns, names = [], []
for k in (4, 8, 16, 132):
    for name in ("loads_k", "loads_sum_k", "bulk_k", "bulk_sum_k"):
        f = mod.get_function(name)
        smem = ring if name.startswith("bulk") else 160 * 1024
        f.max_dynamic_shared_size_bytes = smem
        n = nbytes // 16 if name.startswith("loads") else nbytes
        fns.append(lambda f=f, k=k, n=n, smem=smem: f((k,), (THREADS,), (src, cp.uint64(n), out), shared_mem=smem))
        names.append(f"{name:12s} on {k:3d} SMs")
for name, ms in zip(names, time_interleaved(fns, rounds=3, repeat=3)):
    k = int(name.split()[-2])
    print(f"{name}  {ms:8.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  {nbytes / ms / 1e6 / k:6.1f} GB/s per SM")
