"""`gpucore memory`: where a training run's memory goes, planned and (on a GPU) measured.

    gpucore memory --model d48 -B 16 -T 1024 [--zero 1 --ranks 8] [--master-weights sr] [--optimizer sfadamw]
    gpucore memory --model d12 -B 64 --dtype fp8          (the FP8 linears' plan: kept FP8 inputs, no bf16 ln/GELU)

The plan is model.memory_plan (the same numbers the training banner prints and
the start-up check compares with the free memory): one flat buffer each for
params, grads, the fp32 master copy, the optimizer's two moments, the
activations kept for the backward pass, the backward scratch; with ZeRO-1
the per-rank plan of gpucore.distributed.parallel.plan_for. Activations are
listed by tensor, largest first. On a GPU (unless --no-measure) it builds the
model, trains one step on random tokens, and prints the CuPy memory pool's
high-water mark next to the plan: the difference is what the plan does not
hold (cuBLAS workspaces, per-op temporaries, the encoder's sort, the loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MemoryReport:
    plan: dict                   # buffer -> bytes (per rank)
    activations: list            # [(name, bytes)], largest first
    measured: int | None = None  # CuPy pool bytes after one training step

    @property
    def planned(self) -> int:
        return sum(self.plan.values())


def plan_run(model: str, B: int, T: int | None, dtype: str = "auto", master_weights: str = "fp32",
             ranks: int = 1, zero: int = 0, keep_gelu: bool = False) -> tuple[object, int, object, MemoryReport]:
    """(config, T, dtype, report without measurement) for a preset and batch; keep_gelu: the GELU
    outputs stored per layer (model.resolve_keep_gelu decides it for a training run). dtype "fp8":
    a bf16 model with FP8 linears (the returned dtype is bfloat16)."""
    from . import dtypes
    from .distributed.parallel import plan_for
    from .model import GPT2Config, activation_specs, grad_activation_specs, memory_plan
    from .tensors import TensorLayout
    cfg = GPT2Config.from_preset(model)
    T = T or min(1024, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise ValueError(f"-T {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    fp8 = dtype == "fp8"
    dt = dtypes.normalize("bfloat16" if dtype in ("auto", "fp8") else dtype)      # a plan for a GPU run
    if master_weights != "fp32" and dt != dtypes.bfloat16:
        raise ValueError(f"--master-weights {master_weights}: only bf16 models drop the fp32 master copy")
    plan = memory_plan(cfg, B, T, dt, master_weights=master_weights, keep_gelu=keep_gelu, fp8=fp8)
    if ranks > 1 or zero:
        plan = plan_for(plan, ranks, zero)
    acts = [(s.name, s.nbytes) for s in TensorLayout(activation_specs(cfg, B, T, dt, keep_gelu, fp8))]
    acts += [(s.name, s.nbytes) for s in TensorLayout(grad_activation_specs(cfg, B, T, dt))]
    acts.sort(key=lambda kv: -kv[1])
    return cfg, T, dt, MemoryReport(plan, acts)


def measure_one_step(cfg, B: int, T: int, dtype, optimizer: str = "adamw", master_weights: str = "fp32",
                     keep_gelu: bool = False, fp8: str | None = None) -> int:
    """Bytes the CuPy memory pool (and the compressible buffers beside it) hold after building the
    model and training one step on random tokens; fp8: the FP8 linears' scaling mode, or None."""
    from . import compressible, runtime
    from .model import GPT2
    from .optim import AdamW, ScheduleFreeAdamW
    from .train import train_step
    cp = runtime.cupy
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    model = GPT2(cfg, xp=cp, dtype=dtype, seed=1337, keep_gelu=keep_gelu, fp8=fp8)
    model.allocate_grads()
    model.allocate_activations(B, T)
    cls = ScheduleFreeAdamW if optimizer == "sfadamw" else AdamW
    opt = cls(model, master_weights=master_weights)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32))
    y = cp.asarray(rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32))
    float(train_step(model, opt, lambda: (x, y), 1, 1e-4)[0])
    cp.cuda.Device().synchronize()
    return compressible.device_bytes()


def format_report(report: MemoryReport, top: int = 6) -> str:
    mib = 2 ** 20
    lines = [f"{'buffer':<16}{'MiB':>12}"]
    lines += [f"{name:<16}{size / mib:>12,.1f}" for name, size in report.plan.items() if size]
    lines.append(f"{'total (plan)':<16}{report.planned / mib:>12,.1f}   ({report.planned / 2**30:.2f} GiB)")
    lines.append("largest activations: " + ", ".join(f"{n} {b / mib:,.1f} MiB" for n, b in report.activations[:top]))
    if report.measured is not None:
        diff = report.measured - report.planned
        lines.append(f"measured after one step: {report.measured / mib:,.1f} MiB (CuPy pool) = plan "
                     f"{'+' if diff >= 0 else '-'} {abs(diff) / mib:,.1f} MiB ({100 * diff / report.planned:+.1f}%: "
                     "cuBLAS workspaces, per-op temporaries)")
    return "\n".join(lines)
