"""`gpucore tune`: search cuBLASLt's configurations for every GEMM of a training step, once per machine.

Every training run races the cuBLASLt heuristic's few candidates per GEMM shape and keeps the
winner in the tune cache (gpucore/cublas.py). `tune` runs one training step of a model preset
on random tokens with settings.lt_search (gpucore/lt_search.py), so that each GEMM's race also
gets the fastest of up to --budget configurations from cuBLASLt's whole space, and writes the
winners into the tune cache that later `gpucore train` runs read: they then run the searched
algorithms, with no search and no race of their own. It prints, per GEMM, the heuristic's best,
gemmEx, the best searched configuration and the winner (times from the race: ms per call).

The race runs on a private cache first (so earlier winners do not stop it). Then whole steps
decide (`check_steps`, default 10): the same model runs `check_steps` steps with the searched
winners and as many with the heuristic's own (a race without the search), in ABBA order, and the
searched winners are merged into the real cache only if their steps are faster by more than
CHECK_MARGIN; else the heuristic's winners are (replacing any searched ones from an earlier tune).
Why: a GEMM that wins its race alone can lose in the step. The H200 trains at its 700 W cap,
so a faster but hungrier kernel takes clock from everything after it: at d48 B=16 bf16 the
searched winners, 0.2 ms a step faster in their races, made whole steps 2.7% slower (310.1 vs
318.5 ms, tools/notes/matmul.md). Bits: a searched algorithm is as deterministic as any other
(the cache makes two runs on one machine use the same one); it may round differently from the
heuristic's, like any change of algorithm.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click


CHECK_MARGIN = 0.005          # searched winners must make whole steps this much faster to be kept


def run_tune(model: str = "d12", B: int = 64, T: int | None = None, dtype: str = "bf16", budget: int = 1500,
             fp8_scaling: str = "adaptive", cache_path=None, check_steps: int = 10) -> dict:
    """Search and race every GEMM of one training step; check the winners on whole steps against
    the heuristic's (check_steps per variant and round, 0: no check) and merge the better set into
    the tune cache (cache_path, or the settings' file). Returns {"seconds", "cache", "entries",
    "rows": [...], "check": {...} or None} (see format_rows)."""
    from . import cublas, runtime, settings
    from .profile import synthetic_training
    if budget < 1:
        raise ValueError(f"--budget {budget}: must be at least 1")
    if check_steps < 0:
        raise ValueError(f"--check-steps {check_steps}: must be 0 or more")
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
            run = synthetic_training(model, B, T, "cuda", dtype, fp8_scaling)
            float(run.step()[0])
            won = dict(lt.tune_cache().entries())
        seconds = time.perf_counter() - t0
        rows = plan_rows(lt)
        check = None
        if check_steps:
            heuristic = str(Path(tmp) / "heuristic.json")
            check = check_whole_steps(run, lt, {"heuristic": heuristic, "searched": private}, check_steps)
            if not keep_searched(check["heuristic_ms"], check["searched_ms"]):
                won = dict(cublas.TuneCache(heuristic).entries())
                check["kept"] = "heuristic"
            else:
                check["kept"] = "searched"
        del run
    real = cublas.TuneCache(target)
    for key, value in won.items():
        real.put(key, value)
    lt.forget()                           # later calls in this process read the merged file
    return {"seconds": seconds, "cache": str(target), "entries": len(won), "rows": rows, "check": check}


def keep_searched(heuristic_ms: float, searched_ms: float, margin: float = CHECK_MARGIN) -> bool:
    """Are the searched winners worth keeping: whole steps faster by more than `margin`?"""
    return searched_ms < heuristic_ms * (1.0 - margin)


def check_whole_steps(run, lt, caches: dict, steps: int) -> dict:
    """ms per step of `run` with each tune cache in `caches` ({name: path}), in ABBA order: the
    mean of two rounds of `steps` timed steps each, after one untimed step that restores -- or,
    for a cache still empty, races -- the GEMMs' choices. Returns {name + "_ms": ms}."""
    from . import settings
    from .profile import time_steps
    names = list(caches)
    times = {n: [] for n in names}
    for order in (names, names[::-1]):
        for name in order:
            lt.forget()                   # plans and choices come from this cache's file again
            with settings.using(lt_search=0, lt_tune_cache=caches[name], lt_autotune=True):
                float(run.step()[0])
                times[name].append(time_steps(run.step, steps, "cuda"))
    lt.forget()
    return {f"{n}_ms": sum(t) / len(t) for n, t in times.items()}


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
                 f"one call of each")
    c = report.get("check")
    if c:
        lines.append(f"whole steps: heuristic's winners {c['heuristic_ms']:.2f} ms, searched {c['searched_ms']:.2f} ms "
                     f"(x{c['heuristic_ms'] / c['searched_ms']:.3f}): kept the {c['kept']}")
    lines.append(f"{report['entries']} choices merged into {report['cache']}")
    return "\n".join(lines)


@click.command("tune")
@click.option("--model", default="d12", show_default=True, help="model preset")
@click.option("-B", "--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("-T", "--seq-len", type=click.IntRange(min=1), default=None, help="[default: min(1024, maxT)]")
@click.option("--dtype", type=click.Choice(["bf16", "bfloat16", "fp8"]), default="bf16", show_default=True)
@click.option("--budget", type=click.IntRange(min=1), default=1500, show_default=True,
              help="configurations drawn from cuBLASLt's space per GEMM (lt_search)")
@click.option("--check-steps", type=click.IntRange(min=0), default=10, show_default=True,
              help="whole steps per variant and round that decide between the searched and the heuristic's "
                   "winners (0: keep the searched unchecked)")
def tune_command(model, batch_size, seq_len, dtype, budget, check_steps):
    """Search cuBLASLt's GEMM configurations for a model's training step; later runs use the winners."""
    from .model import PRESETS
    from .startup import TrainError
    if model not in PRESETS:
        raise click.ClickException(f"--model {model}: unknown preset; known: {', '.join(PRESETS)}")
    try:
        report = run_tune(model, batch_size, seq_len, "bfloat16" if dtype == "bf16" else dtype, budget,
                          check_steps=check_steps)
    except (ValueError, TrainError) as e:
        raise click.ClickException(str(e)) from None
    except MemoryError:
        raise click.ClickException(f"out of memory for {model} B={batch_size}: try a smaller -B or -T") from None
    click.echo(format_rows(report))
