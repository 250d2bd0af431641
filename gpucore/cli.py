"""The `gpucore` command line (click): info, kernels check, bench, prepro, train, export, sample.

`train` is also ./train.py's command (the same click object). Its options
take their defaults from gpucore.train.TrainArgs, the one place they are
written; the loop itself is gpucore.train.run.

Errors a user can cause (bad arguments, missing files, no GPU) end as one
line on stderr and a non-zero exit code, never a traceback; Ctrl-C during
training exits 130 after saving and printing the resume command.
"""
from __future__ import annotations

import os
import shlex
import sys

import click

from . import runtime
from .startup import TrainError, resolve_backend
from .train import TrainArgs, TrainInterrupted, run


class UserError(click.ClickException):
    """One clear line for the user, exit code 1."""


def _parse_opts(pairs):
    opts = {}
    for p in pairs:
        if "=" not in p:
            raise click.BadParameter(f"expected KEY=VALUE, got {p!r}", param_hint="--opt")
        k, v = p.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        opts[k.replace("-", "_")] = v
    return opts


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpucore")
def main():
    """gpucore: GPT-2 training on NVIDIA GPUs with hand-written CUDA kernels."""


@main.command()
def info():
    """GPU, CUDA and CuPy versions, and whether each kernel file compiles."""
    import numpy as np
    click.echo(f"numpy {np.__version__}")
    if runtime.cupy is None:
        click.echo("cupy: not installed (CPU reference backend only); pip install 'gpucore[cuda12]'")
        return
    cupy = runtime.cupy
    click.echo(f"cupy {cupy.__version__}")
    try:
        click.echo(f"NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
    except Exception as e:  # NVRTC library missing
        click.echo(f"NVRTC: not found ({e.__class__.__name__})")
    if not runtime.gpu_available():
        click.echo("GPU: none found (kernels can still be compile-checked: gpucore kernels check)")
        return
    dev = cupy.cuda.Device()
    props = runtime.device_properties()
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    free, total = cupy.cuda.runtime.memGetInfo()
    click.echo(f"GPU {dev.id}: {name}, compute capability {dev.compute_capability}, "
               f"{props['multiProcessorCount']} SMs, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)")
    rt, drv = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    click.echo(f"CUDA runtime {rt // 1000}.{rt % 1000 // 10}, driver {drv // 1000}.{drv % 1000 // 10}")
    for path in runtime.kernel_files():
        family = path.relative_to(runtime.KERNEL_DIR).with_suffix("").as_posix()   # e.g. attention/flash_fwd
        try:
            runtime.load_module(family)
            click.echo(f"  {family + '.cu':<36s} compiles (sm_{runtime.device_arch()})")
        except runtime.KernelCompileError as e:
            click.echo(f"  {family + '.cu':<36s} FAILS: {str(e).splitlines()[0]}")


@main.group()
def kernels():
    """Kernel tools (compile check without a GPU)."""


@kernels.command("check")
@click.option("--arch", "archs", multiple=True, default=("80", "90"), show_default=True,
              help="compute capability to compile for (repeatable), e.g. 80, 90")
@click.option("--quiet", "-q", is_flag=True, help="print only the failures and the summary line")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def kernels_check(archs, quiet, files):
    """Compile every kernel file with NVRTC; fail on any error or local-memory spill.

    ptxas' report is cached beside the cubin (same key), so an unchanged file is not compiled again.
    """
    from pathlib import Path
    if runtime.cupy is None:
        raise UserError("the compile check needs CuPy and NVRTC: pip install 'gpucore[cuda12]'")
    rows = runtime.check_kernels(archs, [Path(f) for f in files] or None)
    bad = 0
    for r in rows:
        bad += not r["ok"]
        if quiet and r["ok"]:
            continue
        status = "ok" if r["ok"] else f"FAIL ({r['error']})"
        regs = f"{r['registers']:>3} regs, {r['stack']} B stack" if r.get("registers") is not None else ""
        click.echo(f"{r['file']:<26s} sm_{r['arch']}  {r['kernel']:<48s} {regs:<22s} {status}")
    n_files = len({r["file"] for r in rows})
    click.echo(f"{len(rows) - bad} kernels ok, {bad} failed, {n_files} files, archs {', '.join(archs)}")
    if bad:
        sys.exit(1)


def _bench_names() -> list[str]:
    """The registered benchmarks (importing gpucore.bench needs no GPU: CuPy is imported when one runs)."""
    from . import bench as benchmod
    return sorted(benchmod.BENCHES)


class _BenchCommand(click.Command):
    """`gpucore bench --help` ends with the benchmark names (read when the help is shown)."""

    def format_epilog(self, ctx, formatter):
        formatter.write_paragraph()
        formatter.write_text("Benchmarks: " + ", ".join(_bench_names()) + ", all")
        super().format_epilog(ctx, formatter)


@main.command(cls=_BenchCommand)
@click.argument("name")
@click.option("--n", type=int, default=None, help="number of elements (memory-bound kernels)")
@click.option("--dtype", default=None, help="float32, bfloat16 or all")
@click.option("--version", "version", default=None, help="kernel version (matmul, attention): e.g. 4 or all")
@click.option("--opt", "opts", multiple=True, help="extra KEY=VALUE passed to the benchmark")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="also draw the results against their references into this PNG (needs gpucore[plot])")
def bench(name, n, dtype, version, opts, plot_path):
    """Time kernel NAME on the GPU against the measured ceilings (NAME=all runs every one)."""
    import difflib
    known = _bench_names()
    if name != "all" and name not in known:   # before the GPU check: a typo is not a missing GPU
        close = difflib.get_close_matches(name, known, n=1)
        raise UserError(f"unknown benchmark {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; known: {', '.join(known)}, all")
    kwargs = _parse_opts(opts)
    if plot_path:   # before the GPU work: a missing matplotlib should not cost a benchmark run
        from .plot import PlotError, plot_bench, require_matplotlib
        try:
            require_matplotlib()
        except PlotError as e:
            raise UserError(str(e)) from None
    if not runtime.gpu_available():
        raise UserError("gpucore bench needs an NVIDIA GPU and CuPy; none found")
    from . import bench as benchmod
    for k, v in (("n", n), ("dtype", dtype), ("version", version)):
        if v is not None:
            kwargs[k] = v
    names = known if name == "all" else [name]
    click.echo(f"# {benchmod.device_name()}, copy bandwidth {benchmod.copy_bandwidth_gbps():.0f} GB/s (read+write)")
    results = []
    for nm in names:
        for r in benchmod.run(nm, **kwargs):
            click.echo(r.line())
            results.append(r)
    if plot_path:
        try:
            click.echo(f"plot: {plot_bench(results, plot_path, f'gpucore bench {name}, {benchmod.device_name()}')}")
        except (PlotError, OSError) as e:
            raise UserError(f"--plot: {e}") from None


@main.command()
@click.argument("input", required=False, type=click.Path(dir_okay=False))
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="where to write the shards [default: data/tinyshakespeare, or data/<stem> for INPUT]")
@click.option("--val-tokens", type=click.IntRange(min=1), default=32768, show_default=True,
              help="the first this many tokens form the validation split")
def prepro(input, out_dir, val_tokens):  # noqa: A002 - click names it after the argument
    """Tokenize a text file (default: bundled Tiny Shakespeare) into <name>_train.bin / <name>_val.bin.

    llm.c's recipe: split on blank lines, <|endoftext|> before each section,
    GPT-2 BPE; the first --val-tokens tokens are the validation split.
    """
    from . import data
    try:
        res = data.prepro(input, out_dir, val_tokens)
    except (data.DataError, OSError) as e:
        raise UserError(str(e)) from None
    for split in ("train", "val"):
        path, n = res[split]
        click.echo(f"{split}: {n:,} tokens -> {path}")


# ------------------------------------------------------------------ train ----
# The options of `gpucore train` and ./train.py. Their defaults are TrainArgs' (one place); click
# passes every option by the name of its TrainArgs field.

_D = TrainArgs()
_CHOICES_DEVICE = click.Choice(["auto", "cuda", "cpu"])

_TRAIN_OPTIONS = [
    click.option("--model", default=_D.model,
                 help="model preset: d12 d24 d36 d48 (GPT-2 124M..1558M), tiny, small, micro "
                      "[default: d12, the checkpoint's with --resume, the weights' with --init-from]"),
    click.option("-B", "--batch-size", type=click.IntRange(min=1), default=_D.batch_size, show_default=True,
                 help="sequences per micro-batch"),
    click.option("-T", "--seq-len", type=click.IntRange(min=1), default=_D.seq_len,
                 help="sequence length [default: min(1024, the model's max_seq_len)]"),
    click.option("--total-batch-size", type=click.IntRange(min=1), default=_D.total_batch_size,
                 help="tokens per optimizer step, a multiple of B*T (gradient accumulation) [default: B*T]"),
    click.option("--steps", type=click.IntRange(min=1), default=_D.steps, show_default=True,
                 help="optimizer steps (the schedule's length; keep it when resuming)"),
    click.option("--lr", type=click.FloatRange(min=0), default=_D.lr, show_default=True, help="peak learning rate"),
    click.option("--warmup", type=click.IntRange(min=0), default=_D.warmup, show_default=True,
                 help="linear warmup steps"),
    click.option("--final-lr-frac", type=click.FloatRange(0, 1), default=_D.final_lr_frac, show_default=True,
                 help="cosine decay to lr*this at the last step (1.0: constant after warmup)"),
    click.option("--weight-decay", type=click.FloatRange(min=0), default=_D.weight_decay, show_default=True,
                 help="AdamW weight decay (matrices only)"),
    click.option("--grad-clip", type=click.FloatRange(min=0), default=_D.grad_clip, show_default=True,
                 help="clip the global gradient norm to this (0: off)"),
    click.option("--beta1", type=float, default=_D.beta1, show_default=True),
    click.option("--beta2", type=float, default=_D.beta2, show_default=True),
    click.option("--seed", type=int, default=_D.seed, show_default=True, help="weight init and sampling seed"),
    click.option("--data", default=_D.data, show_default=True,
                 help="token shards: a directory (<dir>/*_train*.bin, *_val*.bin), a file or a glob; "
                      "make Tiny Shakespeare's with `gpucore prepro`"),
    click.option("--shuffle/--no-shuffle", default=_D.shuffle,
                 help="train batches in a new random order every epoch (shards and the B x T batches in "
                      "them permuted from --seed, as llm.c's train loader does); validation stays in order "
                      "[default: off; a resumed run keeps its checkpoint's order]"),
    click.option("--device", type=_CHOICES_DEVICE, default=_D.device, show_default=True,
                 help="cuda (CuPy kernels) or cpu (NumPy references); auto: cuda if a GPU is found"),
    click.option("--dtype", type=click.Choice(["auto", "bf16", "bfloat16", "fp32", "float32", "fp8"]),
                 default=_D.dtype, show_default=True,
                 help="bf16 mixed precision or fp32; fp8: bf16 with the linear layers' GEMMs in FP8 "
                      "(E4M3 x/W, E5M2 gradients; sm_89+); auto: bf16 on cuda, fp32 on cpu"),
    click.option("--fp8-scaling", type=click.Choice(["adaptive", "current", "delayed"]), default=_D.fp8_scaling,
                 show_default=True,
                 help="--dtype fp8: the last step's scale, re-cast on the GPU when a tensor's own amax "
                      "says it is off (adaptive); each tensor's own amax, one more read (current); the "
                      "last 16 steps' amax (delayed: it spiked without lr warmup; tools/notes/fp8.md)"),
    click.option("--val-every", type=click.IntRange(min=0), default=_D.val_every, show_default=True,
                 help="validation loss every N steps and at the end (0: off)"),
    click.option("--val-steps", type=click.IntRange(min=1), default=_D.val_steps, show_default=True,
                 help="validation batches (at most what the val split holds)"),
    click.option("--sample-every", type=click.IntRange(min=0), default=_D.sample_every, show_default=True,
                 help="print a generated text sample every N steps and at the end (0: off)"),
    click.option("--sample-tokens", type=click.IntRange(min=1), default=_D.sample_tokens, show_default=True),
    click.option("--ckpt-every", type=click.IntRange(min=0), default=_D.ckpt_every, show_default=True,
                 help="checkpoint every N steps (0: only at the end)"),
    click.option("--keep-last", type=click.IntRange(min=0), default=_D.keep_last, show_default=True,
                 help="after each checkpoint, delete all but the newest N in the out-dir (0: keep all)"),
    click.option("--checkpoint/--no-checkpoint", default=_D.checkpoint, show_default=True,
                 help="write checkpoints at all"),
    click.option("--out-dir", default=_D.out_dir, help="checkpoints and metrics.jsonl [default: out/<model>]"),
    click.option("--resume", default=_D.resume, type=click.Path(),
                 help="continue from a checkpoint file, or the newest intact ckpt_*.ckpt in a directory"),
    click.option("--init-from", default=_D.init_from,
                 help="start from these weights (fresh optimizer, step 0): a Hugging Face GPT-2 directory, "
                      ".safetensors file or hub name (gpt2, gpt2-medium, ...), an llm.c model file, or a "
                      "gpucore checkpoint; the model config comes from them"),
    click.option("--metrics", default=_D.metrics, type=click.Path(dir_okay=False),
                 help="metrics JSONL file [default: <out-dir>/metrics.jsonl]"),
    click.option("--optimizer", type=click.Choice(["adamw", "sfadamw"]), default=_D.optimizer, show_default=True,
                 help="adamw, or sfadamw: schedule-free AdamW (no lr decay; evaluates, samples and exports "
                      "its averaged weights)"),
    click.option("--master-weights", type=click.Choice(["fp32", "sr", "kahan"]), default=_D.master_weights,
                 show_default=True,
                 help="bf16 runs: keep fp32 master weights, or none: bf16 weights updated with stochastic "
                      "rounding (sr) or with a bf16 Kahan compensation buffer (kahan)"),
    click.option("--keep-gelu", type=click.Choice(["auto", "on", "off"]), default=_D.keep_gelu, show_default=True,
                 help="store each layer's GELU output for the backward (on; L x B x T x 4C values) or "
                      "recompute it there (off); auto: store on a GPU while the run's memory plan stays "
                      "within a third of the device's memory"),
    click.option("--cuda-graph", type=click.Choice(["auto", "on", "off"]), default=_D.cuda_graph, show_default=True,
                 help="replay each micro-batch's forward + backward from a CUDA graph captured at step 2 "
                      "(same kernels, same bits, one host call instead of ~1,000 launches); auto: on a "
                      "GPU unless data parallel, eager for the rest of the run if the capture fails"),
    click.option("--nproc", type=click.IntRange(min=0), default=_D.nproc, show_default=True,
                 help="data parallel on this machine: start N ranks, one GPU each (0: this process trains; "
                      "with mpirun/srun the launcher starts the ranks)"),
    click.option("--zero", type=click.IntRange(0, 1), default=_D.zero, show_default=True,
                 help="1: ZeRO-1, shard the fp32 master weights and AdamW state across the ranks"),
    click.option("--dist-timeout", type=click.FloatRange(min=1), default=_D.dist_timeout, show_default=True,
                 help="data parallel: seconds without progress before a rank ends the job"),
]

# Settings a resumed run takes from its checkpoint, so the resume command leaves them out.
_FROM_CHECKPOINT = {"model", "dtype", "fp8_scaling", "resume", "init_from"}


def train_options(fn):
    """Apply the options of `gpucore train` (defined once, above) to fn."""
    for opt in reversed(_TRAIN_OPTIONS):
        fn = opt(fn)
    return fn


def resume_command(args: TrainArgs, checkpoint) -> str:
    """The `gpucore train` command line that continues `args`' run from `checkpoint`.

    --steps always (it is the schedule's length), then every option that
    differs from its default, except what the checkpoint itself records.
    """
    words = ["gpucore", "train", "--resume", str(checkpoint), "--steps", str(args.steps)]
    for param in train.params:
        if not isinstance(param, click.Option) or param.name in _FROM_CHECKPOINT | {"steps"}:
            continue
        value = getattr(args, param.name)
        if value == param.default:
            continue
        if param.is_flag and param.secondary_opts:
            words.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@train_options
def train(**options):
    """Train GPT-2 (d12..d48, or a tiny preset on the CPU); the same command as ./train.py.

    Needs token shards: `gpucore prepro` writes Tiny Shakespeare's to data/tinyshakespeare/.
    Ctrl-C saves the last completed step and prints the command that resumes it.
    """
    args = TrainArgs(**options)
    if args.nproc and "GPUCORE_WORLD_SIZE" not in os.environ:     # the launcher, not a rank
        from dataclasses import asdict
        from .distributed.launch import spawn
        sys.exit(spawn(asdict(args), args.nproc))
    run_training(args)


def run_training(args: TrainArgs) -> None:
    """Train and exit the way the command line does (also each --nproc worker's body)."""
    try:
        run(args, echo=click.echo)
    except TrainInterrupted as e:
        from .distributed.launch import detect
        if detect().rank == 0:     # data parallel: rank 0 speaks for the job
            click.echo(str(e), err=True)
            if e.checkpoint is not None:
                click.echo(f"resume with: {resume_command(args, e.checkpoint)}", err=True)
        sys.exit(130)          # the shell's code for "ended by SIGINT"
    except TrainError as e:
        click.echo(f"Error: {e}", err=True)
        from .distributed.launch import abort_job
        abort_job()            # under mpirun: end every rank now (the others would wait for this one)
        sys.exit(1)


# ----------------------------------------------------------------- export ----

@main.command()
@click.argument("source", metavar="CKPT")
@click.option("--format", "fmt", type=click.Choice(["hf", "llmc"]), required=True,
              help="hf: a Hugging Face GPT-2 directory (model.safetensors + config.json, fp32); "
                   "llmc: an llm.c model file")
@click.option("--out", required=True, type=click.Path(), help="the directory (hf) or file (llmc) to write")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="llm.c file precision (version 3 / 5); hf is always float32")
def export(source, fmt, out, dtype):
    """Write the weights of CKPT as a Hugging Face GPT-2 or an llm.c model file.

    CKPT: a gpucore checkpoint file or run directory (its newest intact checkpoint), an llm.c
    model file, a Hugging Face directory / .safetensors file, or a hub name (gpt2, ...).
    """
    from .weights import WeightsError, read_weights, write_hf, write_llmc
    if fmt == "hf" and dtype != "float32":
        raise UserError("--dtype: the Hugging Face export is float32 only")
    try:
        cfg, flat, desc = read_weights(source)
        if fmt == "hf":
            write_hf(out, cfg, flat)
        else:
            write_llmc(out, cfg, flat, dtype)
    except WeightsError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{e.filename or out}: {e.strerror}") from None
    click.echo(f"{desc}: {cfg.describe()} -> {out} ({'Hugging Face' if fmt == 'hf' else 'llm.c ' + dtype})")


# ----------------------------------------------------------------- sample ----

@main.command()
@click.option("--checkpoint", "checkpoint", required=True, type=click.Path(),
              help="a checkpoint file, or a directory (its newest intact ckpt_*.ckpt)")
@click.option("--prompt", default="", help="text to continue [default: start of a document]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="softmax temperature (0: greedy)")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: no top-k")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=_CHOICES_DEVICE, default="auto", show_default=True)
def sample(checkpoint, prompt, max_tokens, temperature, top_k, seed, device):
    """Generate text from a checkpoint (KV cache; temperature, top-k)."""
    import numpy as np

    from . import tokenizer
    from .checkpoint import CheckpointError, load_model
    from .sample import generate
    try:
        _, xp, _ = resolve_backend(device, "float32")
        model, _ = load_model(checkpoint, xp=xp, on_skip=lambda note: click.echo(note, err=True))
    except (TrainError, CheckpointError) as e:
        raise UserError(str(e)) from None
    gpt2_vocab = model.config.vocab_size == tokenizer.VOCAB_SIZE
    if prompt and not gpt2_vocab:
        raise UserError(f"--prompt: the model's vocabulary ({model.config.vocab_size} tokens) is not GPT-2's")
    ids = tokenizer.encode(prompt) if prompt else []
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=top_k or None,
                   rng=np.random.default_rng(seed))
    click.echo((prompt + tokenizer.decode(out)) if gpt2_vocab else " ".join(map(str, out)))


@main.command()
@click.option("--model", default="d12", show_default=True, help="model preset")
@click.option("-B", "--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("-T", "--seq-len", type=click.IntRange(min=1), default=None, help="[default: min(1024, maxT)]")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "bfloat16", "fp32", "float32", "fp8"]), default="auto",
              show_default=True, help="auto: bf16 (the plan of a GPU run); fp8: bf16 with FP8 linears")
@click.option("--optimizer", type=click.Choice(["adamw", "sfadamw"]), default="adamw", show_default=True)
@click.option("--master-weights", type=click.Choice(["fp32", "sr", "kahan"]), default="fp32", show_default=True)
@click.option("--zero", type=click.IntRange(0, 1), default=0, show_default=True, help="ZeRO-1: per-rank plan")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="data-parallel ranks")
@click.option("--keep-gelu", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="GELU outputs stored per layer (on) or recomputed (off); auto: as `gpucore train` "
                   "decides on this machine's GPU (off without one)")
@click.option("--measure/--no-measure", default=True, show_default=True,
              help="on a GPU, train one step and print the measured peak next to the plan")
def memory(model, batch_size, seq_len, dtype, optimizer, master_weights, keep_gelu, zero, ranks, measure):
    """A training run's memory: the plan per buffer (what the training banner prints), the largest
    activations, and on a GPU the measured peak after one step."""
    from .memory import format_report, measure_one_step, plan_run
    from .model import resolve_keep_gelu
    device = "cuda" if runtime.gpu_available() else "cpu"
    keep = {"auto": None, "on": True, "off": False}[keep_gelu]
    try:
        fp8 = dtype == "fp8"
        if keep is None:
            cfg0, T0, dt0, _ = plan_run(model, batch_size, seq_len, dtype, master_weights)
            keep = device == "cuda" and resolve_keep_gelu(None, cfg0, batch_size, T0, dt0, runtime.cupy,
                                                          master_weights=master_weights, fp8=fp8)
        cfg, T, dt, report = plan_run(model, batch_size, seq_len, dtype, master_weights, ranks, zero, keep)
    except ValueError as e:
        raise UserError(str(e)) from None
    from . import dtypes
    click.echo(f"{model}: {cfg.describe()} | {cfg.num_parameters:,} parameters | B={batch_size} T={T} | "
               f"{dtypes.name(dt)}{' + FP8 linears' if fp8 else ''} | {optimizer}, master weights {master_weights}"
               + (f" | {ranks} ranks, ZeRO-1 (per rank)" if zero else (f" | {ranks} ranks" if ranks > 1 else ""))
               + f" | GELU outputs {('kept as FP8' if fp8 else 'kept') if keep else 'recomputed'}")
    if measure and device == "cuda" and not zero:
        report.measured = measure_one_step(cfg, batch_size, T, dt, optimizer, master_weights, keep,
                                           fp8=TrainArgs.fp8_scaling if fp8 else None)
    elif measure and device == "cuda":
        click.echo("(not measured: ZeRO-1 needs the ranks; the plan is per rank)")
    click.echo(format_report(report))


def _register_evaluation_commands():
    # gpucore/evaluate.py defines `eval` and `check-debug-state` next to the code they run.
    from .evaluate import check_debug_state_command, eval_command
    main.add_command(eval_command)
    main.add_command(check_debug_state_command)


_register_evaluation_commands()


def _register_learning_commands():
    # `kernels show` (gpucore/inspect_kernels.py) and `plot` (gpucore/plot.py) live beside their code.
    from .inspect_kernels import show_command
    from .plot import plot_command
    kernels.add_command(show_command)
    main.add_command(plot_command)


_register_learning_commands()


def _register_profile_command():
    # `profile` (gpucore/profile.py) and `tune` (gpucore/tune.py) live beside the code they run.
    from .profile import profile_command
    from .tune import tune_command
    main.add_command(profile_command)
    main.add_command(tune_command)


_register_profile_command()


if __name__ == "__main__":
    main()
