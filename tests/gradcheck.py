"""Finite-difference gradient checks in float64, shared by the reference backward tests.

`numerical_grad(f, x)` perturbs every element of x (central differences) and
returns d(sum(f(x) * probe))/dx for a fixed random probe, so a backward that
takes an upstream gradient `dout = probe` can be compared directly.
"""
import numpy as np


def numerical_grad(f, x: np.ndarray, probe: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d/dx of sum(f(x) * probe), by central differences in float64. f must not keep x."""
    x = x.astype(np.float64)
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = float(np.sum(f(x) * probe))
        flat[i] = old - eps
        minus = float(np.sum(f(x) * probe))
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


def assert_grad_close(analytic, numeric, rtol=1e-5, name="grad"):
    analytic = np.asarray(analytic, np.float64)
    denom = max(np.linalg.norm(numeric), 1e-12)
    err = np.linalg.norm(analytic - numeric) / denom
    assert err < rtol, f"{name}: relative error {err:.3e} >= {rtol:.1e}"
