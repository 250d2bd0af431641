"""`gpucore bench softmax|classifier|adamw|grad_norm`: memory-bound kernels against the copy bandwidth.

Bytes are the minimum through device memory: every input read once, every
output written once (a kernel that re-reads from L2 is not credited for it).
Targets (issue 3): 70% of the copy bandwidth for each of
  softmax     forward and backward, rows x C = 65536 x 768, bf16      (--n rows, --opt C=...)
  classifier  fused loss + dlogits in place, 8192 x Vp=50304, bf16 (the model's LM-head chunk;
              65536 rows would pass the kernels' 32-bit indexing)   (--n rows, --opt V=..., Vp=...)
  adamw       124,475,904 parameters (GPT-2 124M, padded vocabulary): fp32 master/m/v,
              bf16 grads and bf16 working copy, decay spans and clipping on   (--n params)
  grad_norm   (no target in the issue; reported for the optimizer step's budget)
--version all (default) times every kernel version that applies; --version 1, 2 or 3 one of them
(softmax v3 is a forward kernel; its backward is v2's and is not timed twice).
--dtype bfloat16 (default), float32 or all.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes
from ..settings import current
from . import (Result, available_versions, benchmark, copy_bandwidth_gbps, dtype_list, random_array, time_ms,
               version_list)

GPT2_PARAMS = 124_475_904


@benchmark("softmax")
def bench_softmax(n: int = 65536, dtype: str = "bfloat16", version=None, C: int = 768, **_):
    import gpucore
    from ..ops import softmax as sm
    rows, C = int(n), int(C)
    bw = copy_bandwidth_gbps()
    results = []
    for dt in dtype_list(dtype):
        x = random_array((rows, C), dt, 3.0)
        y = gpucore.softmax(x)
        dout = random_array((rows, C), dt)
        dx = gpucore.softmax_backward(dout, y)
        available = available_versions(sm.pick_version, sm.VERSIONS, x.dtype, C, (x, y, dout, dx))
        for ver in version_list(version, available):
            tag = f"{dtypes.name(x.dtype)} ({rows},{C}) v{ver}"
            ms = time_ms(lambda: gpucore.softmax(x, out=y, version=ver))
            results.append(Result(f"softmax forward {tag}", ms, bytes=2 * x.nbytes, ref_gbps=bw, target=0.7))
            if ver == 3:                              # v3's backward is v2's kernel
                continue
            ms = time_ms(lambda: gpucore.softmax_backward(dout, y, dx=dx, version=ver))
            results.append(Result(f"softmax backward {tag}", ms, bytes=3 * x.nbytes, ref_gbps=bw, target=0.7))
        del x, y, dout, dx
    return results


@benchmark("classifier")
def bench_classifier(n: int = 8192, dtype: str = "bfloat16", version=None, V: int = 50257, Vp: int = 50304, **_):
    import cupy

    import gpucore
    from ..ops import classifier as cls
    N, V, Vp = int(n), int(V), int(Vp)
    bw = copy_bandwidth_gbps()
    results = []
    for dt in dtype_list(dtype):
        logits = random_array((N, Vp), dt, 2.0)
        targets = cupy.random.randint(0, V, size=N, dtype=np.int32)
        losses = cupy.empty(N, dtype=np.float32)
        io = N * 8                                    # targets read + losses written
        tag = f"{dtypes.name(logits.dtype)} N={N} V={V} Vp={Vp}"
        # the public call: target check (one tiny kernel + 12-byte read-back) + the fused kernel.
        # Repeated calls run on the previous call's dlogits: same work, finite values.
        ms = time_ms(lambda: gpucore.fused_classifier(logits, targets, vocab_size=V, losses=losses))
        results.append(Result(f"fused_classifier (API, checked) {tag}", ms, bytes=2 * logits.nbytes + io,
                              ref_gbps=bw))
        # as the model's training step calls it: grad_scale given, no target check, no host sync
        ms = time_ms(lambda: gpucore.fused_classifier(logits, targets, vocab_size=V, grad_scale=1.0 / N,
                                                      losses=losses, check_targets=False))
        results.append(Result(f"fused_classifier (API, as the model) {tag}", ms, bytes=2 * logits.nbytes + io,
                              ref_gbps=bw, target=0.7))
        available = available_versions(cls.pick_version, cls.VERSIONS, logits, Vp)
        for ver in version_list(version, available):
            ms = time_ms(lambda: cls.launch_fused(logits, targets, losses, V, 1.0 / N, ver))
            results.append(Result(f"fused_classifier kernel v{ver} {tag}", ms, bytes=2 * logits.nbytes + io,
                                  ref_gbps=bw, target=0.7))
        if logits.dtype == dtypes.bfloat16 and cls.pick_version(None, logits, Vp) == 3:
            from ..ops.fp8 import fp8_supported
            if fp8_supported()[0]:
                # as the FP8 model calls it (settings.fp8_lm_head_dwte): the E5M2 dlogits only
                d8 = cupy.empty((N, Vp), np.uint8)
                s8 = cls.dlogits_fp8_scale(1.0 / N)
                ms = time_ms(lambda: cls.launch_fused_fp8(logits, targets, losses, V, 1.0 / N, d8, s8,
                                                           write_dlogits=False))
                results.append(Result(f"fused_classifier FP8 kernel, E5M2 dlogits only {tag}", ms,
                                      bytes=logits.nbytes + d8.nbytes + io, ref_gbps=bw, target=0.7))
                # the same, thinned (settings.fp8_lm_head_sparse, the --dtype fp8 default: f16 rows)
                tau = cls.sparse_tau_of(current().fp8_lm_head_sparse or 2.0 ** -13, 1.0 / N, s8)
                seed = cupy.asarray([1], np.uint32)
                ms = time_ms(lambda: cls.launch_fused_fp8(logits, targets, losses, V, 1.0 / N, d8, s8,
                                                           write_dlogits=False, sparse_tau=tau, sparse_seed=seed))
                results.append(Result(f"fused_classifier FP8 kernel, E5M2 only, thinned {tag}", ms,
                                      bytes=logits.nbytes + d8.nbytes + io, ref_gbps=bw))
                del d8
        ms = time_ms(lambda: gpucore.cross_entropy(logits, targets, vocab_size=V, losses=losses,
                                                   check_targets=False))
        results.append(Result(f"cross_entropy (API, unchecked) {tag}", ms, bytes=logits.nbytes + io, ref_gbps=bw))
        del logits
    return results


@benchmark("adamw")
def bench_adamw(n: int = GPT2_PARAMS, dtype: str = "bfloat16", **_):
    import cupy

    import gpucore
    n = int(n)
    bw = copy_bandwidth_gbps()
    results = []
    for dt in dtype_list(dtype):                      # the grads' dtype
        params = random_array(n, "float32")
        grads = random_array(n, dt, 1e-2)
        m = random_array(n, "float32", 1e-3)
        v = cupy.abs(random_array(n, "float32", 1e-4))
        lowp = params.astype(dtypes.bfloat16)
        # about GPT-2's layout: long decayed matrices with short undecayed gaps (biases, LN gains)
        spans = [(a, min(a + 2_359_296, n)) for a in range(0, n, 2_359_296 + 3_072)]
        norm = gpucore.grad_norm(grads)
        kw = dict(lr=1e-4, step=10, weight_decay=0.1, decay_spans=spans, grad_norm=norm, max_grad_norm=1.0,
                  params_lowp=lowp)
        bytes_ = n * (3 * 4 * 2 + grads.itemsize + 2)  # p, m, v read+written; grads read; bf16 copy written
        ms = time_ms(lambda: gpucore.adamw_update(params, grads, m, v, **kw))
        results.append(Result(f"adamw_update n={n} grads {dtypes.name(grads.dtype)} (+bf16 copy, "
                              f"{len(spans)} decay spans, clip)", ms, bytes=bytes_, ref_gbps=bw, target=0.7))
        del params, grads, m, v, lowp
    return results


@benchmark("grad_norm")
def bench_grad_norm(n: int = GPT2_PARAMS, dtype: str = "bfloat16", **_):
    import gpucore
    n = int(n)
    bw = copy_bandwidth_gbps()
    results = []
    for dt in dtype_list(dtype):
        g = random_array(n, dt)
        out = gpucore.grad_norm(g)
        ms = time_ms(lambda: gpucore.grad_norm(g, out=out))
        results.append(Result(f"grad_norm n={n} {dtypes.name(g.dtype)}", ms, bytes=g.nbytes, ref_gbps=bw))
    return results
