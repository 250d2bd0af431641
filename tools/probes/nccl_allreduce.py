"""nccl_allreduce.py -- how long the data-parallel step's gradient all-reduce takes alone.

One process drives every visible GPU (NCCL's initAll) and times an in-place all-reduce of
`elems` bf16 values on each (the d12 model's flat gradient buffer: 124,475,904), as
GradientReducer.finish() issues it after the graphed backward. Medians of `rounds` x `calls`,
CUDA events on GPU 0's stream; bus bandwidth as nccl-tests counts it (2 (n - 1) / n x bytes / t).

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 python3 tools/probes/nccl_allreduce.py [elems=124475904] [calls=20] [rounds=5]
"""
import statistics
import sys

import cupy as cp
from cupy.cuda import nccl


def main():
    kw = dict(a.split("=") for a in sys.argv[1:])
    elems, calls, rounds = int(kw.get("elems", 124475904)), int(kw.get("calls", 20)), int(kw.get("rounds", 5))
    n = cp.cuda.runtime.getDeviceCount()
    comms = nccl.NcclCommunicator.initAll(list(range(n)))
    bufs, streams = [], []
    for d in range(n):
        with cp.cuda.Device(d):
            bufs.append(cp.ones(elems, dtype=cp.uint16))      # bf16 bits; the values do not matter
            streams.append(cp.cuda.Stream(non_blocking=True))

    def all_reduce():
        nccl.groupStart()
        for d in range(n):
            with cp.cuda.Device(d):
                comms[d].allReduce(bufs[d].data.ptr, bufs[d].data.ptr, elems, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                                   streams[d].ptr)
        nccl.groupEnd()

    for _ in range(3):
        all_reduce()
    times = []
    for _ in range(rounds):
        with cp.cuda.Device(0):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(streams[0])
        for _ in range(calls):
            all_reduce()
        with cp.cuda.Device(0):
            stop.record(streams[0])
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / calls)
    t = statistics.median(times)
    nbytes = 2 * elems
    busbw = 2 * (n - 1) / n * nbytes / (t * 1e-3) / 1e9
    print(f"{n} GPUs ({cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}), NCCL {nccl.get_version()}: "
          f"all-reduce of {elems:,} bf16 ({nbytes / 1e6:.0f} MB) {t:.3f} ms median "
          f"(rounds {', '.join(f'{x:.3f}' for x in times)}), bus bandwidth {busbw:.0f} GB/s")


if __name__ == "__main__":
    main()
