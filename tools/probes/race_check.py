"""Probe: does the one-time cuBLASLt race (cublas.CublasLt.choose: 3 rounds x 3 calls, min) pick
the candidate that is fastest when timed at length? For each GEMM of a model's training step
(bf16, the training path's calls), after the race: every heuristic candidate timed in alternation
(medians of 9 rounds x 10 calls), the race's pick against the best, and the ms a step loses.
With energy=1 each candidate instead runs back to back for `seconds` under the board's energy
counter (gpucore/power.py): J and ms per call at the clock the power cap gives it, the race's pick
against the most frugal candidate, and the joules a step spends over it (at the 700 W cap a step
takes about its energy / 700 W, so joules, not milliseconds, are what a pick should save).
With frugal_cache=PATH (energy=1) the fewest-joules candidate within `margin` (3%) of the fastest
one's ms is written per GEMM into a tune cache at PATH, for a whole-step A/B against the usual
race (`GPUCORE_SETTINGS=lt_tune_cache=PATH` in tools/ab_train.py; a GEMM missing there races).
Run:  PYTHONPATH=. python3 tools/probes/race_check.py [model=d12] [rounds=9] [energy=0] [seconds=0.3]
      [frugal_cache=PATH] [margin=0.03]
"""
import os
import sys
import tempfile

import cupy as cp
import numpy as np

import gpucore
from gpucore import cublas, power, settings
from gpucore.bench import time_interleaved
from gpucore.ops.matmul import matmul_backward, matmul_forward

opts = dict(model="d12", rounds="9", energy="0", seconds="0.3", frugal_cache="", margin="0.03")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
M, C, L = {"d12": (65536, 768, 12), "d48": (16384, 1600, 48)}[opts["model"]]
V = 50304
BF = gpucore.bfloat16
rng = np.random.default_rng(0)


def rnd(shape, s=1.0):
    return cp.asarray((s * rng.standard_normal(shape)).astype(np.float32)).astype(BF)


def gemms():
    """(name, calls per step, fn) of the step's GEMMs, as the model calls them."""
    out = []
    for name, n_out, k_in in (("qkv", 3 * C, C), ("attproj", C, C), ("fc", 4 * C, C), ("fcproj", C, 4 * C)):
        x, w, b = rnd((M, k_in)), rnd((n_out, k_in), 0.05), rnd((n_out,), 0.1)
        y, aux, dy = cp.empty((M, n_out), BF), cp.empty((M, n_out), BF), rnd((M, n_out), 0.01)
        dx, dw = cp.empty((M, k_in), BF), cp.zeros((n_out, k_in), BF)
        if name == "fc":
            out.append((f"{name} fwd", L, lambda x=x, w=w, b=b, y=y, aux=aux: matmul_forward(x, w, b, out=aux,
                                                                                              gelu_out=y)))
        else:
            out.append((f"{name} fwd", L, lambda x=x, w=w, b=b, y=y: matmul_forward(x, w, b, out=y)))
        out.append((f"{name} dx", L, lambda dy=dy, x=x, w=w, dx=dx: matmul_backward(
            dy, x, w, dx=dx, need_dweight=False, need_dbias=False)))
        out.append((f"{name} dW", L, lambda dy=dy, x=x, w=w, dw=dw: matmul_backward(
            dy, x, w, need_dx=False, dweight=dw, need_dbias=False)))
    rows = 8192                                    # the LM head's chunk (lm_head_chunk_bytes)
    x, w, y = rnd((rows, C)), rnd((V, C), 0.05), cp.empty((rows, V), BF)
    dx, dw = cp.empty((rows, C), BF), cp.zeros((V, C), BF)
    chunks = M // rows
    out.append(("head fwd", chunks, lambda: matmul_forward(x, w, None, out=y)))
    out.append(("head dx+dW", chunks, lambda: matmul_backward(y, x, w, dx=dx, dweight=dw, need_dbias=False)))
    return out


ENERGY = opts["energy"] == "1"
meter = power.open_meter() if ENERGY else None
if ENERGY and meter is None:
    sys.exit("energy=1 needs NVML (libnvidia-ml)")


def sustained(fns):
    """(ms per call, J per call) of each fn, run back to back for `seconds` after as long a warm-up."""
    sync = cp.cuda.Device().synchronize
    out = []
    for fn in fns:
        power.measure(fn, meter, min_seconds=float(opts["seconds"]), sync=sync)     # warm-up: the cap's clock
        r = power.measure(fn, meter, min_seconds=float(opts["seconds"]), sync=sync)
        out.append((1e3 * r.seconds / r.calls, r.joules_per_call))
    return out


FRUGAL = cublas.TuneCache(opts["frugal_cache"]) if ENERGY and opts["frugal_cache"] else None
lost_total = joules_total = 0.0
cache = os.path.join(tempfile.mkdtemp(), "race.json")
with settings.using(lt_tune_cache=cache):
    lt = cublas.lt_binding()
    print(f"{'GEMM':<12}{'plan':<34}{'race pick':>10}{'best':>8}{'pick ms':>9}{'best ms':>9}{'lost/step':>10}  all")
    for name, calls, fn in gemms():
        before = set(lt.plans)
        fn()                                       # plans + races
        cp.cuda.get_current_stream().synchronize()
        for key in [k for k in lt.plans if k not in before]:
            plan = lt.plans[key]
            if plan is None or plan.choice is None or plan.choice == cublas.GEMMEX or len(plan.candidates) < 2:
                print(f"{name:<12}{'(not raced / gemmEx)':<34}")
                continue
            pick = plan.choice

            def forced(i, plan=plan):
                def run():
                    plan.choice = i
                    fn()
                return run
            if ENERGY:
                both = sustained([forced(i) for i in plan.candidates])
                plan.choice = pick
                ms, js = [b[0] for b in both], [b[1] for b in both]
                pi, frugal = plan.candidates.index(pick), min(range(len(js)), key=js.__getitem__)
                if FRUGAL is not None:
                    near = [i for i in range(len(ms)) if ms[i] <= min(ms) * (1 + float(opts["margin"]))]
                    keep = min(near, key=js.__getitem__)
                    FRUGAL.put(lt.tune_key(key), plan.algo_hex(plan.candidates[keep]))
                    print(f"{name:<12} frugal cache: #{keep + 1} ({ms[keep]:.4f} ms, {js[keep]:.4f} J)")
                spent = (js[pi] - js[frugal]) * calls
                joules_total += spent
                print(f"{name:<12}{'#' + str(pi + 1):>6} {ms[pi]:8.4f} ms {js[pi]:8.4f} J | frugal #{frugal + 1} "
                      f"{ms[frugal]:8.4f} ms {js[frugal]:8.4f} J | {spent:7.3f} J/step over  all J: "
                      + " ".join(f"{j:.4f}" for j in js))
                continue
            ms = time_interleaved([forced(i) for i in plan.candidates], rounds=int(opts["rounds"]), repeat=10)
            plan.choice = pick
            best = min(range(len(ms)), key=ms.__getitem__)
            pi = plan.candidates.index(pick)
            # fn may run two GEMMs (head dx+dW): the forced candidate applies to this plan's only
            lost = (ms[pi] - ms[best]) * calls
            lost_total += lost
            desc = f"M{key[3] if len(key) > 5 else '?'} N{key[4] if len(key) > 5 else '?'} K{key[5] if len(key) > 5 else '?'}"
            print(f"{name:<12}{desc:<34}{'#' + str(pi + 1):>10}{'#' + str(best + 1):>8}{ms[pi]:9.4f}{ms[best]:9.4f}"
                  f"{lost:10.3f}  " + " ".join(f"{t:.4f}" for t in ms))
if ENERGY:
    print(f"race picks spend {joules_total:.2f} J per {opts['model']} step over the most frugal candidates")
else:
    print(f"race picks lose {lost_total:.2f} ms per {opts['model']} step against the best at length")
