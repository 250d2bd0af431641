"""Checks shared by the matmul-family tests (test_matmul, test_cublas, test_colsum, ladder/test_gemm)."""
import numpy as np

import gpucore
from conftest import rel_err, to_cpu

BF16 = gpucore.bfloat16
TOL = {np.dtype(np.float32): 1e-5, np.dtype(BF16): 1e-2}


def rand(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def check_close(out, ref, dtype, what, tol=None):
    """rel error under the dtype's tolerance, no NaN; on failure name the first wrong (row, col)."""
    out = np.asarray(to_cpu(out), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    tol = tol or TOL[np.dtype(dtype)]
    err = rel_err(out, ref)
    if not (err < tol) or np.isnan(out).any():
        o2, r2 = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
        scale = np.abs(r2).max() if r2.size else 1.0
        bad = np.argwhere(~(np.abs(o2 - r2) <= 4 * tol * max(scale, 1e-30)))
        first = tuple(int(v) for v in bad[0]) if len(bad) else None
        detail = (f"first wrong (row, col) {first}: got {o2[first]}, want {r2[first]}; "
                  f"{len(bad)} of {o2.size} wrong" if first else "")
        raise AssertionError(f"{what}: rel err {err:.3e} (tol {tol:.0e}), NaN: {bool(np.isnan(out).any())}; {detail}")
