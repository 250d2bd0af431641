"""The `gpucore` command line (click): info, kernels check, bench, and the engine commands.

Errors a user can cause (bad arguments, missing files, no GPU) end as one
line on stderr and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import sys

import click

from . import runtime


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
        try:
            runtime.load_module(path.stem)
            click.echo(f"  {path.name:<20s} compiles (sm_{runtime.device_arch()})")
        except runtime.KernelCompileError as e:
            click.echo(f"  {path.name:<20s} FAILS: {str(e).splitlines()[0]}")


@main.group()
def kernels():
    """Kernel tools (compile check without a GPU)."""


@kernels.command("check")
@click.option("--arch", "archs", multiple=True, default=("80", "90"), show_default=True,
              help="compute capability to compile for (repeatable), e.g. 80, 90")
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def kernels_check(archs, files):
    """Compile every kernels_cu/*.cu with NVRTC; fail on any error or local-memory spill."""
    from pathlib import Path
    if runtime.cupy is None:
        raise UserError("the compile check needs CuPy and NVRTC: pip install 'gpucore[cuda12]'")
    rows = runtime.check_kernels(archs, [Path(f) for f in files] or None)
    bad = 0
    for r in rows:
        status = "ok" if r["ok"] else f"FAIL ({r['error']})"
        regs = f"{r['registers']:>3} regs, {r['stack']} B stack" if r.get("registers") is not None else ""
        click.echo(f"{r['file']:<26s} sm_{r['arch']}  {r['kernel']:<48s} {regs:<22s} {status}")
        bad += not r["ok"]
    n_files = len({r["file"] for r in rows})
    click.echo(f"{len(rows) - bad} kernels ok, {bad} failed, {n_files} files, archs {', '.join(archs)}")
    if bad:
        sys.exit(1)


@main.command()
@click.argument("name")
@click.option("--n", type=int, default=None, help="number of elements (memory-bound kernels)")
@click.option("--dtype", default=None, help="float32, bfloat16 or all")
@click.option("--version", "version", default=None, help="kernel version (matmul, attention): e.g. 4 or all")
@click.option("--opt", "opts", multiple=True, help="extra KEY=VALUE passed to the benchmark")
def bench(name, n, dtype, version, opts):
    """Time kernel NAME on the GPU against the measured ceilings (NAME=all runs every one)."""
    from . import bench as benchmod
    if not runtime.gpu_available():
        raise UserError("gpucore bench needs an NVIDIA GPU and CuPy; none found")
    kwargs = _parse_opts(opts)
    for k, v in (("n", n), ("dtype", dtype), ("version", version)):
        if v is not None:
            kwargs[k] = v
    names = sorted(benchmod.BENCHES) if name == "all" else [name]
    for nm in names:
        if nm not in benchmod.BENCHES:
            raise UserError(f"unknown benchmark {nm!r}; known: {', '.join(sorted(benchmod.BENCHES))}")
    click.echo(f"# {benchmod.device_name()}, copy bandwidth {benchmod.copy_bandwidth_gbps():.0f} GB/s (read+write)")
    for nm in names:
        for r in benchmod.run(nm, **kwargs):
            click.echo(r.line())


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


from .train import sample_options, train_options  # noqa: E402 (imports only click and numpy)


@main.command()
@train_options
def train(**options):
    """Train GPT-2 (d12..d48, or a tiny preset on the CPU); the same command as ./train.py.

    Needs token shards: `gpucore prepro` writes Tiny Shakespeare's to data/tinyshakespeare/.
    """
    from .train import main_from_options
    main_from_options(**options)


@main.command()
@sample_options
def sample(**options):
    """Generate text from a checkpoint (KV cache; temperature, top-k)."""
    from .train import sample_from_options
    sample_from_options(**options)


if __name__ == "__main__":
    main()
