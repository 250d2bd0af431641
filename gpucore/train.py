"""The training loop shared by `gpucore train` and ./train.py (same options, same function).

    gpucore prepro                         # data/tinyshakespeare/tinyshakespeare_{train,val}.bin
    gpucore train --model d12 -B 64 -T 1024 --steps 30
    gpucore train --model tiny --device cpu --steps 40      # the NumPy backend
    gpucore train --resume out/d12                          # continue bit-identically
    gpucore sample --checkpoint out/d12 --prompt "ROMEO:"

One optimizer step (train_step): zero the gradients; for each of grad_accum
micro-batches, forward(for_backward=True) with grad_scale = 1/(total tokens)
so the accumulated gradient is the mean over the whole batch, then backward;
then AdamW (gpucore.optim) with the learning rate of the schedule, clipping
by the global gradient norm inside the update. The loss of a step is the mean
of its micro-batch losses. Only two host syncs per step: the loss and the
norm, read after the update is queued.

Everything a run depends on is in its checkpoint, so `--resume` continues
bit-identically: parameters (and fp32 master weights), AdamW m/v and step
count, the optimizer step, the data loader's position, the sampling RNG, the
model config and dtype. Checkpoints are written atomically
(gpucore.checkpoint): an interrupted save never damages an existing file.

Errors a user can cause (unknown preset, a batch size that does not divide,
missing data, a corrupt checkpoint, running out of GPU memory) end as one
line and exit code 1 (click.ClickException), never a traceback.

This module imports only click and NumPy at import time: gpucore.cli imports
it to build its `train` and `sample` commands.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

CHECKPOINT_FORMAT = "gpucore-gpt2-train"
# Dense bf16 tensor-core peak of the GPUs we know (SXM parts), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
DEFAULT_DATA = "data/tinyshakespeare"


class TrainError(Exception):
    """A problem the user can fix, reported as one line."""


@dataclass
class TrainArgs:
    model: str | None = None          # preset; None: d12, or the checkpoint's when resuming
    batch_size: int = 4
    seq_len: int | None = None        # None: min(1024, the model's max_seq_len)
    total_batch_size: int | None = None   # tokens per optimizer step; None: B*T (no accumulation)
    steps: int = 50
    lr: float = 3e-4
    warmup: int = 0
    final_lr_frac: float = 1.0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 1337
    data: str = DEFAULT_DATA
    device: str = "auto"
    dtype: str = "auto"
    val_every: int = 25
    val_steps: int = 20
    sample_every: int = 50
    sample_tokens: int = 64
    ckpt_every: int = 0
    checkpoint: bool = True
    out_dir: str | None = None
    resume: str | None = None
    metrics: str | None = None


# ---------------------------------------------------------------- options ----

_TRAIN_OPTIONS = [
    click.option("--model", default=None,
                 help="model preset: d12 d24 d36 d48 (GPT-2 124M..1558M), tiny, small, micro "
                      "[default: d12, or the checkpoint's with --resume]"),
    click.option("-B", "--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
                 help="sequences per micro-batch"),
    click.option("-T", "--seq-len", type=click.IntRange(min=1), default=None,
                 help="sequence length [default: min(1024, the model's max_seq_len)]"),
    click.option("--total-batch-size", type=click.IntRange(min=1), default=None,
                 help="tokens per optimizer step, a multiple of B*T (gradient accumulation) [default: B*T]"),
    click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True,
                 help="optimizer steps (the schedule's length; keep it when resuming)"),
    click.option("--lr", type=click.FloatRange(min=0), default=3e-4, show_default=True, help="peak learning rate"),
    click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
                 help="linear warmup steps"),
    click.option("--final-lr-frac", type=click.FloatRange(0, 1), default=1.0, show_default=True,
                 help="cosine decay to lr*this at the last step (1.0: constant after warmup)"),
    click.option("--weight-decay", type=click.FloatRange(min=0), default=0.1, show_default=True,
                 help="AdamW weight decay (matrices only)"),
    click.option("--grad-clip", type=click.FloatRange(min=0), default=1.0, show_default=True,
                 help="clip the global gradient norm to this (0: off)"),
    click.option("--beta1", type=float, default=0.9, show_default=True),
    click.option("--beta2", type=float, default=0.95, show_default=True),
    click.option("--seed", type=int, default=1337, show_default=True, help="weight init and sampling seed"),
    click.option("--data", default=DEFAULT_DATA, show_default=True,
                 help="token shards: a directory (<dir>/*_train*.bin, *_val*.bin), a file or a glob; "
                      "make Tiny Shakespeare's with `gpucore prepro`"),
    click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
                 help="cuda (CuPy kernels) or cpu (NumPy references); auto: cuda if a GPU is found"),
    click.option("--dtype", type=click.Choice(["auto", "bf16", "bfloat16", "fp32", "float32"]), default="auto",
                 show_default=True, help="bf16 mixed precision or fp32; auto: bf16 on cuda, fp32 on cpu"),
    click.option("--val-every", type=click.IntRange(min=0), default=25, show_default=True,
                 help="validation loss every N steps and at the end (0: off)"),
    click.option("--val-steps", type=click.IntRange(min=1), default=20, show_default=True,
                 help="validation batches (at most what the val split holds)"),
    click.option("--sample-every", type=click.IntRange(min=0), default=50, show_default=True,
                 help="print a generated text sample every N steps and at the end (0: off)"),
    click.option("--sample-tokens", type=click.IntRange(min=1), default=64, show_default=True),
    click.option("--ckpt-every", type=click.IntRange(min=0), default=0, show_default=True,
                 help="checkpoint every N steps (0: only at the end)"),
    click.option("--checkpoint/--no-checkpoint", default=True, show_default=True,
                 help="write checkpoints at all"),
    click.option("--out-dir", default=None, help="checkpoints and metrics.jsonl [default: out/<model>]"),
    click.option("--resume", default=None, type=click.Path(),
                 help="continue from a checkpoint file, or the latest ckpt_*.ckpt in a directory"),
    click.option("--metrics", default=None, type=click.Path(dir_okay=False),
                 help="metrics JSONL file [default: <out-dir>/metrics.jsonl]"),
]

_SAMPLE_OPTIONS = [
    click.option("--checkpoint", "checkpoint", required=True, type=click.Path(),
                 help="a checkpoint file, or a directory (its latest ckpt_*.ckpt)"),
    click.option("--prompt", default="", help="text to continue [default: start of a document]"),
    click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True),
    click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True,
                 help="softmax temperature (0: greedy)"),
    click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: no top-k"),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True),
]


def _apply(options, fn):
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def train_options(fn):
    """The click options of `gpucore train` and ./train.py (defined once, here)."""
    return _apply(_TRAIN_OPTIONS, fn)


def sample_options(fn):
    return _apply(_SAMPLE_OPTIONS, fn)


def main_from_options(**options):
    """`gpucore train` and ./train.py: run, turning user errors into one line + exit code 1."""
    try:
        run(TrainArgs(**options))
    except TrainError as e:
        raise click.ClickException(str(e)) from None


def sample_from_options(**options):
    """`gpucore sample`."""
    try:
        sample_checkpoint(**options)
    except TrainError as e:
        raise click.ClickException(str(e)) from None


# ----------------------------------------------------------------- backend ----

def resolve_backend(device: str, dtype: str = "auto"):
    """(device, xp, dtype) from the --device / --dtype choices."""
    from . import dtypes, runtime
    if device == "auto":
        device = "cuda" if runtime.gpu_available() else "cpu"
    if device == "cuda" and not runtime.gpu_available():
        raise TrainError("--device cuda: no NVIDIA GPU found (or CuPy is not installed); use --device cpu")
    xp = runtime.cupy if device == "cuda" else np
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, xp, dtypes.normalize(dtype)


def _oom_types():
    from . import runtime
    return (runtime.cupy.cuda.memory.OutOfMemoryError,) if runtime.cupy is not None else ()


def gpu_memory_info():
    """(free, total) bytes of the current GPU, or None."""
    from . import runtime
    try:
        return runtime.cupy.cuda.runtime.memGetInfo()
    except Exception:
        return None


def format_plan(plan: dict) -> str:
    parts = [f"{k} {v / 2**20:,.1f}" for k, v in plan.items() if v]
    return "memory plan (MiB): " + " | ".join(parts) + f" | total {sum(plan.values()) / 2**30:.2f} GiB"


def oom_message(plan: dict | None) -> str:
    need = f"about {sum(plan.values()) / 2**30:.1f} GiB for its buffers ({', '.join(f'{k} {v / 2**30:.2f}' for k, v in plan.items() if v)}) plus kernel scratch" if plan else "more memory"
    info = gpu_memory_info()
    have = f"; the GPU has {info[1] / 2**30:.1f} GiB ({info[0] / 2**30:.1f} GiB free)" if info else ""
    return (f"out of GPU memory: this run needs {need}{have}. "
            "Use a smaller -B (with --total-batch-size to keep the batch) or a smaller model")


def peak_flops(device: str, dtype) -> float | None:
    """Dense bf16 peak of the GPU for MFU (None on CPU, for fp32, or for an unknown GPU)."""
    from . import dtypes, runtime
    if device != "cuda" or dtype != dtypes.bfloat16:
        return None
    props = runtime.device_properties()
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# ------------------------------------------------------------------- steps ----

def train_step(model, optimizer, next_batch, grad_accum: int, lr: float):
    """One optimizer step over grad_accum micro-batches from next_batch(); returns (loss, norm).

    Both are 0-d fp32 arrays on the model's device (read them with float()).
    """
    model.zero_grad()
    total = None
    for _ in range(grad_accum):
        x, y = next_batch()
        scale = 1.0 / (grad_accum * x.size)
        # check_tokens=False: the loader checked the ids against the vocabulary (no host sync here)
        loss = model.forward(x, y, for_backward=True, grad_scale=scale, check_tokens=False)
        model.backward()
        total = loss if total is None else total + loss
    norm = optimizer.step(lr)
    return total / grad_accum, norm


def evaluate(model, loader, steps: int) -> float:
    """Mean loss over the first `steps` batches of `loader` (reset first, as llm.c does)."""
    loader.reset()
    total = None
    for _ in range(steps):
        x, y = loader.next_batch()
        loss = model.forward(x, y, check_tokens=False)
        total = loss if total is None else total + loss
    return float(total) / steps


# ------------------------------------------------------------- checkpoints ----

def find_checkpoint(path) -> Path:
    """A checkpoint file, or the ckpt_*.ckpt with the highest step in a directory."""
    from .checkpoint import CheckpointError
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("ckpt_*.ckpt"))
        if not found:
            raise CheckpointError(f"{p}: no checkpoints (ckpt_*.ckpt) in this directory")
        return found[-1]
    return p


def checkpoint_path(out_dir, step: int) -> Path:
    return Path(out_dir) / f"ckpt_{step:06d}.ckpt"


def save_training_checkpoint(path, model, optimizer, *, step, preset, train_loader=None, rng=None,
                             args: TrainArgs | None = None) -> int:
    from . import dtypes
    from .checkpoint import save_checkpoint
    arrays = {"params": model.params.flat(), **optimizer.state_arrays()}
    meta = {"format": CHECKPOINT_FORMAT, "version": 1, "preset": preset, "config": model.config.to_dict(),
            "dtype": dtypes.name(model.dtype), "step": int(step), "optimizer": optimizer.state_meta(),
            "data": train_loader.state_dict() if train_loader is not None else None,
            "rng": rng.bit_generator.state if rng is not None else None,
            "args": asdict(args) if args is not None else None}
    return save_checkpoint(path, arrays, meta)


def read_training_checkpoint(path):
    """(arrays, meta, path) of a training checkpoint; CheckpointError on anything wrong."""
    from .checkpoint import CheckpointError, load_checkpoint
    from .model import GPT2Config
    path = find_checkpoint(path)
    arrays, meta = load_checkpoint(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a gpucore training checkpoint (format {meta.get('format')!r})")
    try:
        cfg = GPT2Config.from_dict(meta["config"])
        n = cfg.num_parameters
        for name in ("params", "m", "v"):
            if arrays[name].shape != (n,):
                raise ValueError(f"array {name!r} has shape {arrays[name].shape}, the config needs ({n},)")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint ({e.__class__.__name__}: {e})") from None
    return arrays, meta, path


def load_model(path, xp=np, dtype=None):
    """A GPT2 from a checkpoint's weights (fp32 master weights when present), in `dtype`
    (default: float32)."""
    from . import dtypes
    from .model import GPT2, GPT2Config
    arrays, meta, path = read_training_checkpoint(path)
    cfg = GPT2Config.from_dict(meta["config"])
    model = GPT2(cfg, xp=xp, dtype=dtypes.float32 if dtype is None else dtype, seed=None)
    model.load_flat(arrays.get("master", arrays["params"]))
    return model, meta


# --------------------------------------------------------------------- run ----

def _bar(done: int, total: int, width: int = 20) -> str:
    k = int(width * done / max(1, total))
    return "[" + "#" * k + "-" * (width - k) + "]"


def _make_loaders(args, cfg, B, T, xp, echo):
    from . import data as datamod
    try:
        train = datamod.DataLoader(args.data, B, T, split="train", xp=xp, vocab_size=cfg.vocab_size)
    except datamod.DataError as e:
        hint = ""
        if Path(args.data) == Path(DEFAULT_DATA):
            hint = (" -- create the Tiny Shakespeare shards with `gpucore prepro` "
                    f"(writes {DEFAULT_DATA}/tinyshakespeare_{{train,val}}.bin)")
        raise TrainError(f"{e}{hint}") from None
    val = None
    if args.val_every:
        try:   # the val split may hold fewer than B*T tokens: use fewer rows (same buffers)
            probe = datamod.DataLoader(args.data, 1, T, split="val", vocab_size=cfg.vocab_size)
            Bv = min(B, (min(probe.shard_tokens) - 1) // T)
            val = datamod.DataLoader(args.data, Bv, T, split="val", xp=xp, vocab_size=cfg.vocab_size)
        except datamod.DataError as e:
            echo(f"validation off: {e}")
            val = None
    return train, val


def run(args: TrainArgs, echo=click.echo) -> dict:
    """Train as `args` says; returns {"losses": [...], "val_losses": {step: loss}, "checkpoints": [...],
    "step": final step, "peak_gpu_bytes": ...}. Raises TrainError for user-caused problems."""
    from .checkpoint import CheckpointError
    from .data import DataError
    state = {"plan": None}     # the memory plan, once known, for the out-of-memory message
    try:
        return _run(args, echo, state)
    except (CheckpointError, DataError) as e:
        raise TrainError(str(e)) from None
    except _oom_types():
        raise TrainError(oom_message(state["plan"])) from None


def _run(args: TrainArgs, echo, state: dict) -> dict:
    from . import dtypes
    from .model import GPT2, GPT2Config, memory_plan
    from .optim import AdamW, lr_schedule
    arrays = meta = None
    if args.resume:
        arrays, meta, ckpt = read_training_checkpoint(args.resume)
        cfg = GPT2Config.from_dict(meta["config"])
        preset = meta.get("preset") or "custom"
        if args.model is not None and args.model != preset:
            raise TrainError(f"--model {args.model}: the checkpoint {ckpt} is a {preset!r} model")
        device, xp, dtype = resolve_backend(args.device, "auto")
        ckpt_dtype = dtypes.normalize(meta["dtype"])
        if args.dtype != "auto" and dtypes.normalize(args.dtype) != ckpt_dtype:
            raise TrainError(f"--dtype {args.dtype}: the checkpoint {ckpt} was trained in {dtypes.name(ckpt_dtype)}")
        dtype = ckpt_dtype
    else:
        preset = args.model or "d12"
        try:
            cfg = GPT2Config.from_preset(preset)
        except ValueError as e:
            raise TrainError(str(e)) from None
        device, xp, dtype = resolve_backend(args.device, args.dtype)

    B = args.batch_size
    T = args.seq_len or min(1024, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise TrainError(f"-T {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    total = args.total_batch_size or B * T
    if total % (B * T):
        raise TrainError(f"--total-batch-size {total} is not a multiple of B*T = {B}*{T} = {B * T}")
    grad_accum = total // (B * T)
    out_dir = Path(args.out_dir or f"out/{preset}")
    metrics_path = Path(args.metrics) if args.metrics else out_dir / "metrics.jsonl"

    train_loader, val_loader = _make_loaders(args, cfg, B, T, xp, echo)

    plan = memory_plan(cfg, B, T, dtype)
    state["plan"] = plan
    model = GPT2(cfg, xp=xp, dtype=dtype, seed=None if arrays is not None else args.seed)
    model.allocate_grads()
    model.allocate_activations(B, T)
    opt = AdamW(model, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
                max_grad_norm=args.grad_clip or None)
    rng = np.random.default_rng(args.seed)
    start = 0
    if arrays is not None:
        model.load_flat(arrays["params"])
        try:
            opt.load_state(arrays, meta["optimizer"])
            start = int(meta["step"])
            if meta.get("data") is not None:
                train_loader.load_state_dict(meta["data"])
            if meta.get("rng") is not None:
                rng.bit_generator.state = meta["rng"]
        except (KeyError, ValueError, TypeError) as e:
            raise TrainError(f"{ckpt}: cannot resume from this checkpoint ({e})") from None

    # ---- header
    n = model.num_parameters
    echo(f"gpucore train | model {preset}: {cfg.describe()} | {n:,} parameters")
    echo(f"device {device}{' (' + _gpu_name() + ')' if device == 'cuda' else ''} | dtype {dtypes.name(dtype)} | "
         f"B={B} T={T} | {total:,} tokens/step (grad accum {grad_accum}) | steps {args.steps}"
         + (f" | resumed at step {start} from {ckpt}" if arrays is not None else ""))
    echo(f"AdamW lr {args.lr:g} warmup {args.warmup} final lr frac {args.final_lr_frac:g} betas "
         f"({args.beta1:g}, {args.beta2:g}) weight decay {args.weight_decay:g} grad clip {args.grad_clip:g}")
    echo(f"data: train {train_loader.num_tokens:,} tokens ({train_loader.num_batches} batches/epoch)"
         + (f", val {val_loader.num_tokens:,} tokens ({val_loader.B} rows x {T})" if val_loader else ""))
    echo(format_plan(plan))
    if device == "cpu" and n > 20_000_000:
        echo("note: the CPU (NumPy reference) backend is slow for this model; try --model tiny")

    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics = open(metrics_path, "a" if arrays is not None else "w")
    fpt = cfg.flops_per_token(T)
    peak = peak_flops(device, dtype)
    can_sample = args.sample_every and cfg.vocab_size == 50257
    result = {"losses": [], "val_losses": {}, "checkpoints": [], "step": start, "peak_gpu_bytes": None}

    def log(rec):
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    def validate(step):
        vl = evaluate(model, val_loader, min(args.val_steps, val_loader.num_batches))
        result["val_losses"][step] = vl
        echo(f"step {step:>5d} | val loss {vl:.6f}")
        log({"step": step, "val_loss": vl})

    def sample(step):
        from . import tokenizer
        from .sample import generate
        ids = generate(model, [tokenizer.EOT], args.sample_tokens, temperature=1.0, top_k=40, rng=rng)
        text = tokenizer.decode(ids)
        echo(f"step {step:>5d} | sample: {text!r}")
        log({"step": step, "sample": text})

    if arrays is None:
        log({"event": "start", "preset": preset, "config": cfg.to_dict(), "dtype": dtypes.name(dtype),
             "device": device, "args": asdict(args), "parameters": n})
    try:
        for step in range(start, args.steps):
            if val_loader is not None and step % args.val_every == 0:
                validate(step)
            if can_sample and step > start and step % args.sample_every == 0:
                sample(step)
            lr = lr_schedule(step, args.lr, args.steps, args.warmup, args.final_lr_frac)
            t0 = time.perf_counter()
            loss_d, norm_d = train_step(model, opt, train_loader.next_batch, grad_accum, lr)
            loss, norm = float(loss_d), float(norm_d)      # syncs: the step is done
            dt = time.perf_counter() - t0
            tps = total / dt
            mfu = fpt * tps / peak if peak else None
            done = step + 1
            result["losses"].append(loss)
            result["step"] = done
            echo(f"step {done:>5d}/{args.steps} {_bar(done, args.steps)} loss {loss:.6f} | norm {norm:.4f} | "
                 f"lr {lr:.2e} | {dt * 1e3:.1f} ms | {tps:,.0f} tok/s | MFU "
                 + (f"{100 * mfu:.1f}%" if mfu is not None else "-"))
            log({"step": done, "loss": loss, "grad_norm": norm, "lr": lr, "ms": dt * 1e3,
                 "tokens_per_s": tps, "mfu": mfu})
            if done == start + 1 and device == "cuda":
                result["peak_gpu_bytes"] = _pool_bytes()
                echo(f"GPU memory after the first step: {result['peak_gpu_bytes'] / 2**30:.2f} GiB held by "
                     "CuPy's memory pool (its high-water mark)")
            if args.checkpoint and ((args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps):
                path = checkpoint_path(out_dir, done)
                save_training_checkpoint(path, model, opt, step=done, preset=preset, train_loader=train_loader,
                                         rng=rng, args=args)
                result["checkpoints"].append(str(path))
                echo(f"step {done:>5d} | checkpoint {path}")
        if val_loader is not None:
            validate(args.steps)
        if can_sample:
            sample(args.steps)
        if device == "cuda":
            result["peak_gpu_bytes"] = _pool_bytes()
        log({"event": "end", "step": result["step"], "peak_gpu_bytes": result["peak_gpu_bytes"]})
    finally:
        metrics.close()
    return result


def _gpu_name() -> str:
    from . import runtime
    name = runtime.device_properties()["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _pool_bytes() -> int:
    from . import runtime
    return int(runtime.cupy.get_default_memory_pool().total_bytes())


# ------------------------------------------------------------------ sample ----

def sample_checkpoint(checkpoint, prompt="", max_tokens=128, temperature=1.0, top_k=40, seed=0, device="auto",
                      echo=click.echo) -> list[int]:
    """`gpucore sample`: load a checkpoint, continue `prompt`, print the text (ids for a toy vocab)."""
    from . import tokenizer
    from .checkpoint import CheckpointError
    from .sample import generate
    device, xp, _ = resolve_backend(device, "float32")
    try:
        model, meta = load_model(checkpoint, xp=xp)
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    gpt2_vocab = model.config.vocab_size == tokenizer.VOCAB_SIZE
    if prompt and not gpt2_vocab:
        raise TrainError(f"--prompt: the model's vocabulary ({model.config.vocab_size} tokens) is not GPT-2's")
    ids = tokenizer.encode(prompt) if prompt else []
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=top_k or None,
                   rng=np.random.default_rng(seed))
    echo((prompt + tokenizer.decode(out)) if gpt2_vocab else " ".join(map(str, out)))
    return out


# the command object ./train.py runs (gpucore.cli builds `gpucore train` from the same options and function)
command = click.command("train", context_settings={"help_option_names": ["-h", "--help"]},
                        help="Train GPT-2 (the same command as `gpucore train`).")(train_options(main_from_options))
