"""Probe: joules, not milliseconds -- where a training step's energy goes, per op.

The H200 trains GPT-2 at its 700 W cap (tools/notes/profile.md, fifth session), so a step takes
about its energy / 700 W, and a kernel made shorter saves only the energy it no longer spends.
This probe measures that energy with the board's own counter (NVML's total energy, mJ):

  step   a whole training step, run `steps` times: J and ms per step, mean W, SM clock;
  ops    one eager step recorded through gpucore.profiler; every (op, shapes of all its array
         arguments) seen is replayed back to back for `seconds` (after a quarter of that to settle
         the clock), giving J and ms per call alone, the mean power and the SM clock it ran at;
         J per step = J per call x calls per step. "ms in step" against "ms alone" shows what the
         step's clock costs an op. Replays reuse the step's last buffers, so the data is realistic
         but not the call's own (an op updating in place keeps updating: fine for energy);
  copy   a grid-stride 16-byte copy of `mb` MiB on 132 / 99 / 66 / 44 / 33 SMs' worth of blocks:
         GB/s and nJ per byte moved -- do memory passes spend less on fewer SMs?

Run (GPU):  PYTHONPATH=. python3 tools/probes/energy_by_op.py [model=d12] [B=64] [dtype=bf16]
            [what=step,ops,copy] [seconds=0.5] [steps=20] [top=30] [mb=1024]
"""
import sys

from gpucore import power

opts = dict(model="d12", B="64", dtype="bf16", what="step,ops,copy", seconds="0.5", steps="20", top="30",
            mb="1024")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])
WHAT = set(opts["what"].split(","))


def measure(fn, seconds, sync, meter):
    """Run fn back to back: a quarter of `seconds` to settle the clock, then `seconds` measured
    (gpucore.power.measure). Returns (ms per call, J per call, mean W, median SM MHz)."""
    power.measure(fn, meter, min_seconds=seconds / 4, sync=sync)
    r = power.measure(fn, meter, min_seconds=seconds, sync=sync)
    return 1e3 * r.seconds / r.calls, r.joules_per_call, r.watts, r.sm_mhz


def main():
    import cupy
    meter = power.require_meter()
    sync = cupy.cuda.Device().synchronize
    seconds = float(opts["seconds"])
    if WHAT & {"step", "ops"}:
        from gpucore import profiler
        from gpucore.profile import synthetic_training
        run = synthetic_training(opts["model"], int(opts["B"]), None, "cuda", opts["dtype"])
        for _ in range(3):
            float(run.step()[0])
        sync()
        tag = f"{opts['model']} B={opts['B']} {opts['dtype']}"
        step_j = None
        if "step" in WHAT:
            steps = int(opts["steps"])
            ms, j, w, mhz = measure(run.step, steps * 0.1, sync, meter)     # ~steps steps at ~100 ms
            step_j = j
            print(f"{tag}: step {ms:.1f} ms, {j:.2f} J, {w:.0f} W, SM {mhz:.0f} MHz")
        if "ops" in WHAT:
            captured = {}

            class Capture(profiler.Recorder):
                def _record(self, name, fn, args, kwargs, flops, nbytes):
                    shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if hasattr(a, "shape")]
                    label = f"{name} " + " ".join("x".join(map(str, sh)) for sh in shapes)
                    captured.setdefault(label, (fn, args, kwargs))
                    return super()._record(label, fn, args, kwargs, flops, nbytes)

            rec = Capture()
            with profiler.recording(recorder=rec):
                run.step()
            totals = rec.totals()
            rows = sorted(((t.ms, t.calls, name) for name, t in totals.items()), reverse=True)[:int(opts["top"])]
            print(f"{'op and argument shapes':70s} {'calls':>5s} {'ms in step':>10s} {'ms alone':>8s} "
                  f"{'J/step':>7s} {'W':>5s} {'MHz':>5s}")
            total_ms = total_j = 0.0
            for ms, calls, label in rows:
                fn, args, kwargs = captured[label]
                per_ms, per_j, w, mhz = measure(lambda: fn(*args, **kwargs), seconds, sync, meter)
                total_ms += ms
                total_j += per_j * calls
                print(f"{label[:70]:70s} {calls:5d} {ms:10.3f} {per_ms * calls:8.3f} {per_j * calls:7.2f} "
                      f"{w:5.0f} {mhz:5.0f}")
            print(f"top {len(rows)} rows: {total_ms:.1f} ms (as recorded), {total_j:.2f} J replayed"
                  + (f"; the whole step measured {step_j:.2f} J" if step_j else ""))
    if "copy" in WHAT:
        copy_by_sms(meter, sync, seconds)


COPY_SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def copy_by_sms(meter, sync, seconds):
    import cupy
    kern = cupy.RawKernel(COPY_SRC, "copy16")
    nbytes = int(opts["mb"]) << 20
    src = cupy.ones(nbytes // 4, cupy.float32)
    dst = cupy.empty_like(src)
    n = nbytes // 16
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"copy {nbytes >> 20} MiB (read + write), grid-stride, 4 blocks of 512 threads per SM used")
    for used in (sms, sms * 3 // 4, sms // 2, sms // 3, sms // 4):
        def go():
            kern((4 * used,), (512,), (src, dst, cupy.int64(n)))
        ms, j, w, mhz = measure(go, seconds, sync, meter)
        gbps = 2 * nbytes / (ms * 1e-3) / 1e9
        print(f"  {used:4d} SMs: {ms:.3f} ms, {gbps:6.0f} GB/s, {1e9 * j / (2 * nbytes):.3f} nJ/byte, "
              f"{w:.0f} W, SM {mhz:.0f} MHz")


if __name__ == "__main__":
    main()
