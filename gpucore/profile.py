"""`gpucore profile`: where a training step's time goes, per op family.

    gpucore profile --model d12 -B 64 -T 1024 [--steps 3] [--json prof.json] [--plot prof.png]

Builds the model and AdamW as `gpucore memory` does (random tokens, no data
files), runs one warm-up step (kernel compiles, cuBLASLt autotune), times
`steps` plain steps (the step time), then the same number of steps again with
every profiled op timed (gpucore/profiler.py: CUDA events on the GPU, one
synchronize at the end; perf_counter on the CPU). Per row: calls per step, ms
per step, share of the step, TFLOP/s (matmul, attention) or GB/s (the rest:
bytes = the arrays passed in and returned, an approximation), and the share of
the ceiling (the GPU's bf16 peak -- twice it for FP8 GEMMs -- or the device-to-device copy bandwidth). The
host gap is the step time minus the sum of the ops: Python, launches and the
time the GPU waits for them, outside any op. On the GPU, a second of plain steps
before the timed ones reads the board's energy counter (gpucore/power.py): J per step, mean
power against the limit, SM clock against its maximum -- whether the step is
held by the power cap, which decides what can make it faster.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from . import profiler

COPY_BYTES = 256 << 20      # the device-to-device copy measured once for the GB/s ceiling


def _sync(device):
    if device == "cuda":
        from . import runtime
        runtime.cupy.cuda.Device().synchronize()


def _lm_head_labeler(padded_vocab):
    """Rows for the LM head's matmuls (bf16 and FP8) apart from the layers' (its weight is wte: (Vp, C))."""
    def label(name, args, kwargs):
        if name.startswith("matmul"):
            w = args[1 if name == "matmul forward" else 2] if len(args) > (1 if name == "matmul forward" else 2) \
                else kwargs.get("weight")
            if w is not None and w.shape[0] == padded_vocab:
                return name + " (lm head)"
        elif name == "fp8 matmul" and len(args) > 1 and padded_vocab in (*args[0].shape, *args[1].shape):
            return name + " (lm head)"      # logits, dlnf, dwte: one operand spans the vocabulary
        return name
    return label


def copy_bandwidth_gbps(nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), one measurement."""
    from .bench import copy_bandwidth_gbps as measure
    return measure(nbytes)


@dataclass
class SyntheticRun:
    """A model preset and AdamW training on fixed random tokens (x, y): step() runs one training
    step (forward, backward, AdamW) and returns (loss, norm). Shared by `profile` and `tune`."""
    net: object
    opt: object
    x: object
    y: object
    config: object
    device: str
    dtype: object

    def step(self):
        from .train import train_step
        return train_step(self.net, self.opt, lambda: (self.x, self.y), 1, 1e-4)


def synthetic_training(model: str, B: int, T: int | None, device: str, dtype: str,
                       fp8_scaling: str = "adaptive") -> SyntheticRun:
    """A SyntheticRun of preset `model` at batch B and length T (None: min(1024, max_seq_len)) on
    `device` ("auto", "cuda", "cpu") in `dtype` ("fp8": bf16 + FP8 linears with `fp8_scaling`)."""
    from .model import GPT2, GPT2Config
    from .optim import AdamW
    from .startup import resolve_backend
    cfg = GPT2Config.from_preset(model)
    T = T or min(1024, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise ValueError(f"-T {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    fp8 = fp8_scaling if dtype == "fp8" else None
    device, xp, dt = resolve_backend(device, "bfloat16" if fp8 else dtype)
    net = GPT2(cfg, xp=xp, dtype=dt, seed=1337, fp8=fp8)
    net.allocate_grads()
    net.allocate_activations(B, T)
    opt = AdamW(net, weight_decay=0.1, max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32))
    y = xp.asarray(rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32))
    return SyntheticRun(net, opt, x, y, cfg, device, dt)


def time_steps(step, steps: int, device: str) -> float:
    """ms per step of `steps` plain steps back to back (the device drained before and after)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, _ = step()
    float(loss)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def run_profile(model: str = "d12", B: int = 4, T: int | None = None, steps: int = 3, device: str = "auto",
                dtype: str = "auto", fp8_scaling: str = "adaptive") -> dict:
    """Profile `steps` training steps; returns the report as a JSON-able dict (see format_table).
    fp8_scaling: the FP8 linears' scaling mode with dtype "fp8"."""
    from .startup import peak_flops
    if steps < 1:
        raise ValueError(f"--steps {steps}: must be at least 1")
    from . import dtypes
    run = synthetic_training(model, B, T, device, dtype, fp8_scaling)
    net, step, device, dt = run.net, run.step, run.device, run.dtype
    T = run.x.shape[1]
    fp8 = fp8_scaling if dtype == "fp8" else None
    float(step()[0])                       # warm-up: compiles, autotune, first allocations
    _sync(device)
    # Power first: its second of steps also brings the GPU to the clock it trains at, so that the
    # plain and the recorded steps below run at the same one (timed on a cold GPU, the plain steps
    # came out faster than the ops recorded after them, a negative host gap).
    power = _step_power(step, device)
    step_ms = time_steps(step, steps, device)

    t0 = time.perf_counter()
    with profiler.recording(_lm_head_labeler(run.config.padded_vocab_size)) as rec:
        for _ in range(steps):
            step()
    totals = rec.totals()                  # the one synchronize
    recorded_ms = (time.perf_counter() - t0) * 1e3 / steps

    graph_ms, graph_error = _graph_step_ms(net, run.opt, run.x, run.y, steps) if device == "cuda" else (None, None)
    peak = peak_flops(device, dt)
    copy_gbps = copy_bandwidth_gbps() if device == "cuda" else None
    rows = []
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1].ms):
        ms = t.ms / steps
        calls = t.calls / steps
        row = {"op": name, "calls": int(calls) if calls == int(calls) else calls, "ms": ms,
               "share": ms / step_ms}
        if t.flops and t.ms > 0:
            row["tflops"] = t.flops / (t.ms * 1e-3) / 1e12
            ceiling = 2 * peak if peak and name.startswith("fp8 ") else peak   # FP8 tensor cores: 2x bf16
            row["peak_share"] = row["tflops"] * 1e12 / ceiling if ceiling else None
        elif t.bytes and t.ms > 0:
            row["gbps"] = t.bytes / (t.ms * 1e-3) / 1e9
            row["peak_share"] = row["gbps"] / copy_gbps if copy_gbps else None
        rows.append(row)
    ops_ms = sum(r["ms"] for r in rows)
    return {"model": model, "B": B, "T": T, "steps": steps, "device": device,
            "dtype": dtypes.name(dt) + (f" + FP8 linears ({fp8} scaling)" if fp8 else ""),
            "keep_gelu": net.keep_gelu,
            "step_ms": step_ms, "recorded_step_ms": recorded_ms, "ops_ms": ops_ms,
            "host_gap_ms": step_ms - ops_ms, "host_gap_share": (step_ms - ops_ms) / step_ms,
            "peak_tflops": peak / 1e12 if peak else None, "copy_gbps": copy_gbps,
            "graph_step_ms": graph_ms, "graph_error": graph_error, "power": power, "rows": rows}


POWER_SECONDS = 1.0     # the energy counter updates every few ms: a second of steps gives percent-level figures


def _step_power(step, device):
    """PowerReading.as_dict() of plain steps run for POWER_SECONDS (gpucore/power.py), or None off
    the GPU or without NVML."""
    if device != "cuda":
        return None
    from . import power
    meter = power.open_meter()
    if meter is None:
        return None
    return power.measure(step, meter, min_seconds=POWER_SECONDS, sync=lambda: _sync(device)).as_dict()


def _graph_step_ms(net, opt, x, y, steps):
    """(ms per step with forward + backward replayed from a CUDA graph, None) or (None, why not).
    The graph's first call runs eagerly, the second captures; `steps` more are timed."""
    from .step_graph import GraphCaptureError, StepGraph
    from .train import train_step
    graph = StepGraph(net, strict=True)
    try:
        for _ in range(2):
            float(train_step(net, opt, lambda: (x, y), 1, 1e-4, graph=graph)[0])
    except GraphCaptureError as e:
        return None, str(e)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, _ = train_step(net, opt, lambda: (x, y), 1, 1e-4, graph=graph)
    float(loss)
    return (time.perf_counter() - t0) * 1e3 / steps, None


def format_table(report: dict) -> str:
    r = report
    gelu = {True: ", GELU outputs kept", False: ", GELU outputs recomputed"}.get(r.get("keep_gelu"), "")
    lines = [f"{r['model']} B={r['B']} T={r['T']} {r['dtype']} on {r['device']}{gelu}: step {r['step_ms']:.2f} ms "
             f"(mean of {r['steps']}; {r['recorded_step_ms']:.2f} ms while recording)",
             "rate: TFLOP/s for matmul/attention; GB/s for the rest, bytes = arrays in + out (approximate); "
             "% peak: of the bf16 peak (FP8 GEMMs: of the FP8 peak, twice it) / of the measured device-to-device copy"]
    lines.append(f"{'op':<32}{'calls':>7}{'ms':>10}{'% step':>8}{'rate':>17}{'% peak':>8}")
    for row in r["rows"]:
        if "tflops" in row:          # FP8 GEMMs pass 1,000: no exponent, or the columns run together
            t = row["tflops"]
            rate = f"{t:,.0f} TFLOP/s" if t >= 100 else f"{t:.3g} TFLOP/s"
        elif "gbps" in row:
            rate = f"{row['gbps']:.1f} GB/s"
        else:
            rate = ""
        ps = row.get("peak_share")
        calls = f"{row['calls']:g}"
        lines.append(f"{row['op']:<32}{calls:>7}{row['ms']:>10.3f}{100 * row['share']:>7.1f}%{rate:>17}"
                     + (f"{100 * ps:>7.1f}%" if ps is not None else f"{'-':>8}"))
    lines.append(f"{'sum of ops':<32}{'':>7}{r['ops_ms']:>10.3f}{100 * r['ops_ms'] / r['step_ms']:>7.1f}%")
    lines.append(f"{'host gap (step - ops)':<32}{'':>7}{r['host_gap_ms']:>10.3f}{100 * r['host_gap_share']:>7.1f}%")
    lines.append(f"{'step':<32}{'':>7}{r['step_ms']:>10.3f}{100.0:>7.1f}%")
    if r.get("graph_step_ms") is not None:
        g = r["graph_step_ms"]
        lines.append(f"{'step, CUDA graph (--cuda-graph)':<32}{'':>7}{g:>10.3f}{100 * g / r['step_ms']:>7.1f}%"
                     f"   forward + backward replayed: {r['step_ms'] - g:+.3f} ms of host time removed")
    elif r.get("graph_error"):
        lines.append(f"step, CUDA graph: not measured ({r['graph_error']})")
    if r.get("power"):
        from .power import describe
        lines.append(describe(r["power"]))
    return "\n".join(lines)


def write_plot(report: dict, out) -> None:
    """A horizontal bar chart of ms per step per op (and the host gap); needs matplotlib (PlotError)."""
    from .plot import require_matplotlib
    require_matplotlib()
    from matplotlib.figure import Figure
    names = [row["op"] for row in report["rows"]] + ["host gap"]
    ms = [row["ms"] for row in report["rows"]] + [max(0.0, report["host_gap_ms"])]
    fig = Figure(figsize=(8, 0.3 * len(names) + 1.2))
    ax = fig.add_subplot()
    y = list(range(len(names)))[::-1]
    ax.barh(y, ms, color=["tab:blue"] * (len(names) - 1) + ["tab:gray"])
    ax.set_yticks(y, names)
    ax.set_xlabel("ms per step")
    ax.set_title(f"{report['model']} B={report['B']} T={report['T']} {report['dtype']} on {report['device']}: "
                 f"step {report['step_ms']:.2f} ms")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


@click.command("profile")
@click.option("--model", default="d12", show_default=True, help="model preset")
@click.option("-B", "--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("-T", "--seq-len", type=click.IntRange(min=1), default=None, help="[default: min(1024, maxT)]")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="steps timed (after one warm-up)")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "bf16", "bfloat16", "fp32", "float32", "fp8"]), default="auto",
              show_default=True, help="auto: bf16 on the GPU, fp32 on the CPU; fp8: bf16 + FP8 linears")
@click.option("--fp8-scaling", type=click.Choice(["adaptive", "current", "delayed"]), default="adaptive",
              show_default=True, help="--dtype fp8: the scaling mode (gpucore train --help)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the report as JSON here")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write a bar chart (PNG) here; needs matplotlib")
def profile_command(model, batch_size, seq_len, steps, device, dtype, fp8_scaling, json_path, plot_path):
    """Time each op family over a few training steps: ms, share of the step, TFLOP/s or GB/s, host gap."""
    from .model import PRESETS
    from .plot import PlotError, require_matplotlib
    from .startup import TrainError
    if model not in PRESETS:
        raise click.ClickException(f"--model {model}: unknown preset; known: {', '.join(PRESETS)}")
    if plot_path is not None:
        try:
            require_matplotlib()             # before the steps, not after them
        except PlotError as e:
            raise click.ClickException(str(e)) from None
    try:
        report = run_profile(model, batch_size, seq_len, steps, device, dtype, fp8_scaling)
    except (ValueError, TrainError) as e:
        raise click.ClickException(str(e)) from None
    except MemoryError:
        raise click.ClickException(f"out of memory for {model} B={batch_size}: try a smaller -B or -T") from None
    click.echo(format_table(report))
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(report, indent=1) + "\n")
        except OSError as e:
            raise click.ClickException(f"--json {json_path}: {e.strerror or e}") from None
        click.echo(f"wrote {json_path}")
    if plot_path is not None:
        try:
            write_plot(report, plot_path)
        except OSError as e:
            raise click.ClickException(f"--plot {plot_path}: {e.strerror or e}") from None
        click.echo(f"wrote {plot_path}")
