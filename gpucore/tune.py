"""`gpucore tune`: search cuBLASLt's configurations for every GEMM of a training step, once per machine.

Every training run races the cuBLASLt heuristic's few candidates per GEMM shape and keeps the
winner in the tune cache (gpucore/cublas.py). `tune` runs one training step of a model preset
on random tokens with settings.lt_search (gpucore/lt_search.py), so that each GEMM's race also
gets the fastest of up to --budget configurations from cuBLASLt's whole space, and writes the
winners into the tune cache that later `gpucore train` runs read: they then run the searched
algorithms, with no search and no race of their own. It prints, per GEMM, the heuristic's best,
gemmEx, the best searched configuration and the winner (times from the race: ms per call).

The race runs on a private cache first (so earlier winners do not stop it) and the winners
are then merged into the real one. Bits: a searched algorithm is as deterministic as any other
(the cache makes two runs on one machine use the same one); it may round differently from the
heuristic's, like any change of algorithm.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click


def run_tune(model: str = "d12", B: int = 64, T: int | None = None, dtype: str = "bf16", budget: int = 1500,
             fp8_scaling: str = "adaptive", cache_path=None) -> dict:
    """Search and race every GEMM of one training step; merge the winners into the tune cache
    (cache_path, or the settings' file). Returns {"seconds", "cache", "rows": [...]} (see format_rows)."""
    from . import cublas, runtime, settings
    from .profile import synthetic_training
    if budget < 1:
        raise ValueError(f"--budget {budget}: must be at least 1")
    if not runtime.gpu_available():
        raise ValueError("tune searches cuBLASLt's GEMM algorithms: it needs a CUDA GPU")
    lt = cublas.lt_binding()
    if lt is None:
        raise ValueError(f"tune needs cuBLASLt: {cublas.lt_status()}")
    target = Path(cache_path) if cache_path else Path(lt.tune_cache().path)
    with tempfile.TemporaryDirectory() as tmp:
        private = str(Path(tmp) / "algos.json")
        lt.forget()                       # no plan decided in memory: every GEMM races again
        t0 = time.perf_counter()
        with settings.using(lt_search=budget, lt_tune_cache=private, lt_autotune=True):
            float(synthetic_training(model, B, T, "cuda", dtype, fp8_scaling).step()[0])
            won = dict(lt.tune_cache().entries())
        seconds = time.perf_counter() - t0
        rows = plan_rows(lt)
    real = cublas.TuneCache(target)
    for key, value in won.items():
        real.put(key, value)
    lt.forget()                           # later calls in this process read the merged file
    return {"seconds": seconds, "cache": str(target), "entries": len(won), "rows": rows}


def plan_rows(lt) -> list[dict]:
    """One row per raced plan: shape key, heuristic best, gemmEx, best searched, winner (ms per call)."""
    from . import cublas, lt_search
    rows = []
    for key, plan in lt.plans.items():
        if plan is None or plan.times is None or plan.raced is None:
            continue
        t, n_heur, n_raced = plan.times, len(plan.candidates), len(plan.raced)
        gemmex = t[n_raced] if len(t) > n_raced else None
        won_gemmex = plan.choice == cublas.GEMMEX
        rows.append({
            "gemm": describe_key(key),
            "heuristic_ms": min(t[:n_heur]),
            "gemmex_ms": gemmex,
            "searched_ms": min(t[n_heur:n_raced], default=None),
            "winner": "gemmEx" if won_gemmex else plan.label(plan.choice),
            "winner_ms": gemmex if won_gemmex else t[plan.raced.index(plan.choice)],
            "config": "" if won_gemmex else lt_search.describe(lt.lib, plan.algo_ptr(plan.choice)),
        })
    return rows


def describe_key(key) -> str:
    """A plan key in words: "fp8 65536x768x3072 e4m3.e4m3 +bias" or "bf16 65536x2304x768 NT +bias"."""
    if len(key) > 1 and key[1] == "fp8":
        _, _, M, N, K, ta, tb, _, epilogue = key[:9]
        fmt = {28: "e4m3", 29: "e5m2"}
        return f"fp8 {M}x{N}x{K} {fmt.get(ta, ta)}.{fmt.get(tb, tb)}{_epilogue_words(epilogue)}" + \
            (" +=" if key[-2] else "")
    _, op_a, op_b, M, N, K = key[:6]
    epilogue = key[11]
    return f"{M}x{N}x{K} {'TN'[op_a == 0]}{'TN'[op_b == 0]}{_epilogue_words(epilogue)}" + (" +=" if key[-1] else "")


def _epilogue_words(epilogue) -> str:
    return {1: "", 4: " +bias", 160: " +gelu", 164: " +bias+gelu"}.get(epilogue, f" epilogue {epilogue}")


def format_rows(report: dict) -> str:
    rows = report["rows"]
    lines = [f"{'GEMM (M x N x K)':36s} {'heuristic':>9s} {'gemmEx':>8s} {'searched':>8s} {'winner':>9s} {'gain':>6s}"]

    def ms(v):
        return f"{v:8.4f}" if v is not None else f"{'-':>8s}"
    saved = 0.0
    for r in sorted(rows, key=lambda r: r["gemm"]):
        base = min(v for v in (r["heuristic_ms"], r["gemmex_ms"]) if v is not None)
        saved += base - r["winner_ms"]
        lines.append(f"{r['gemm']:36s} {r['heuristic_ms']:9.4f} {ms(r['gemmex_ms'])} {ms(r['searched_ms'])} "
                     f"{r['winner']:>9s} {(base - r['winner_ms']) / base:6.1%}  {r['config']}")
    lines.append(f"{len(rows)} GEMMs raced in {report['seconds']:.0f} s; searched winners save {saved:.4f} ms over "
                 f"one call of each; {report['entries']} choices merged into {report['cache']}")
    return "\n".join(lines)


@click.command("tune")
@click.option("--model", default="d12", show_default=True, help="model preset")
@click.option("-B", "--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("-T", "--seq-len", type=click.IntRange(min=1), default=None, help="[default: min(1024, maxT)]")
@click.option("--dtype", type=click.Choice(["bf16", "bfloat16", "fp8"]), default="bf16", show_default=True)
@click.option("--budget", type=click.IntRange(min=1), default=1500, show_default=True,
              help="configurations drawn from cuBLASLt's space per GEMM (lt_search)")
def tune_command(model, batch_size, seq_len, dtype, budget):
    """Search cuBLASLt's GEMM configurations for a model's training step; later runs use the winners."""
    from .model import PRESETS
    from .startup import TrainError
    if model not in PRESETS:
        raise click.ClickException(f"--model {model}: unknown preset; known: {', '.join(PRESETS)}")
    try:
        report = run_tune(model, batch_size, seq_len, "bfloat16" if dtype == "bf16" else dtype, budget)
    except (ValueError, TrainError) as e:
        raise click.ClickException(str(e)) from None
    except MemoryError:
        raise click.ClickException(f"out of memory for {model} B={batch_size}: try a smaller -B or -T") from None
    click.echo(format_rows(report))
