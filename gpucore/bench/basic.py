"""Benchmarks of the foundation kernels: add, sum, max, cast (memory-bound).

Bytes counted are the minimum through device memory: every input read once,
every output written once. Targets (issue 2): sum over 2^28 float32 >= 80% of
the copy bandwidth (bytes read), casts >= 75% (bytes read + written).
"""
from __future__ import annotations

from .. import dtypes
from . import Result, benchmark, copy_bandwidth_gbps, dtype_list, random_array, time_ms


@benchmark("add")
def bench_add(n: int = 1 << 28, dtype: str = "float32", **_):
    import gpucore
    a, b = random_array(n, dtype), random_array(n, dtype)
    out = a.copy()
    ms = time_ms(lambda: gpucore.add(a, b, out=out))
    return [Result(f"add {dtypes.name(a.dtype)} n={n}", ms, bytes=3 * a.nbytes,
                   ref_gbps=copy_bandwidth_gbps(), target=0.8)]


def _bench_reduce(op, n, dtype):
    import gpucore
    fn = getattr(gpucore, op)
    results = []
    for dt in dtype_list(dtype):
        x = random_array(n, dt)
        out = fn(x)
        ms = time_ms(lambda: fn(x, out=out))
        results.append(Result(f"{op} {dtypes.name(x.dtype)} n={n} (whole)", ms, bytes=x.nbytes,
                              ref_gbps=copy_bandwidth_gbps(), target=0.8))
        rows = n // 768
        x2 = x[: rows * 768].reshape(rows, 768)
        out2 = fn(x2, axis=-1)
        ms = time_ms(lambda: fn(x2, axis=-1, out=out2))
        results.append(Result(f"{op} {dtypes.name(x.dtype)} ({rows},768) last axis", ms,
                              bytes=x2.nbytes + out2.nbytes, ref_gbps=copy_bandwidth_gbps(), target=0.8))
    return results


@benchmark("sum")
def bench_sum(n: int = 1 << 28, dtype: str = "all", **_):
    return _bench_reduce("sum", n, dtype)


@benchmark("max")
def bench_max(n: int = 1 << 28, dtype: str = "all", **_):
    return _bench_reduce("max", n, dtype)


@benchmark("cast")
def bench_cast(n: int = 1 << 28, **_):
    import gpucore
    x = random_array(n, "float32")
    y = gpucore.astype(x, "bfloat16")
    ms1 = time_ms(lambda: gpucore.astype(x, "bfloat16", out=y))
    ms2 = time_ms(lambda: gpucore.astype(y, "float32", out=x))
    bw = copy_bandwidth_gbps()
    return [Result(f"cast float32->bfloat16 n={n}", ms1, bytes=x.nbytes + y.nbytes, ref_gbps=bw, target=0.75),
            Result(f"cast bfloat16->float32 n={n}", ms2, bytes=x.nbytes + y.nbytes, ref_gbps=bw, target=0.75)]


@benchmark("copy")
def bench_copy(n: int = 1 << 28, **_):
    bw = copy_bandwidth_gbps(4 * n)
    return [Result(f"device-to-device memcpy {4 * n} bytes", 2 * 4 * n / bw / 1e6, bytes=2 * 4 * n, ref_gbps=bw)]
