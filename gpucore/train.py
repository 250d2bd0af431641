"""The training loop shared by `gpucore train` and ./train.py (gpucore.cli builds both from TrainArgs).

    from gpucore.train import TrainArgs, run
    run(TrainArgs(model="tiny", device="cpu", steps=20))

One optimizer step (train_step): zero the gradients; for each of grad_accum
micro-batches, forward(for_backward=True) with grad_scale = 1/(total tokens)
so the accumulated gradient is the mean over the whole batch, then backward;
then AdamW (gpucore.optim) with the learning rate of the schedule, clipping
by the global gradient norm inside the update. The loss of a step is the mean
of its micro-batch losses. Only two host syncs per step: the loss and the
norm, read after the update is queued.

run() goes through these stages, each a function below:
  prepare           read the checkpoint to resume from (or the --init-from weights), pick the config, device
                    and dtype, the batch geometry and the paths (allocates nothing)
  check_*           host memory (CPU backend), out-dir and metrics writable
                    (gpucore/startup.py): fail in one line before minutes of work
  build_model       model, optimizer, RNG; restore their state when resuming
  Trainer.loop      steps, validation, samples, metrics rows, checkpoints
Everything a run depends on is in its checkpoint (gpucore.checkpoint), so
`--resume` continues bit-identically.
`--init-from` starts a new run (step 0, fresh AdamW state) from weights that
gpucore.weights reads (Hugging Face GPT-2, llm.c model file, gpucore
checkpoint); the config comes from the weights.

Ctrl-C: the first one lets the current step finish, the second one stops at
once; either way the last completed step is checkpointed (atomically) and
TrainInterrupted (a KeyboardInterrupt) carries its path, for the resume command.

A NaN or inf loss or gradient norm (read at the step's sync anyway) stops the run at
that step with one TrainError line naming the last checkpoint; the step is not
saved, and the metrics file gets a "non-finite" event row instead of its step row.

Data parallel (gpucore.distributed): started as one of N ranks (mpirun, srun,
or --nproc N, which starts the ranks itself), run() connects to the peers
first; each rank reads its slice of every batch, the gradients are reduced
across ranks while the backward pass runs, and rank 0 alone prints, writes
metrics and checkpoints (whole-state checkpoints: resumable on any number of
ranks). --zero 1 shards the optimizer state (ZeRO-1).

Errors a user can cause (unknown preset, a batch size that does not divide,
missing data, a corrupt checkpoint, an unwritable out-dir, not enough memory)
raise TrainError with one line; the CLI prints it and exits 1.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .startup import (TrainError, check_gpu_memory, check_host_memory, check_metrics_file, check_output_dir, choose_device,
                      format_plan, gpu_name, oom_error_types, oom_message, os_reason, peak_flops, resolve_backend,
                      trim_metrics)
from . import compressible, settings, step_graph
from .checkpoint import (CHECKPOINT_GLOB, CheckpointError, checkpoint_path, prune_checkpoints,
                         read_training_checkpoint, remove_stale_temp_files, save_training_checkpoint)

DEFAULT_DATA = "data/tinyshakespeare"


class TrainInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after `step` completed steps; `checkpoint` holds them (None: not saved)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint


@dataclass
class TrainArgs:
    """Every setting of a run; the defaults here are the CLI's defaults (gpucore.cli reads them)."""
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
    shuffle: bool | None = None       # train batches in a per-epoch permuted order (None: off, or the checkpoint's)
    device: str = "auto"
    dtype: str = "auto"
    val_every: int = 25
    val_steps: int = 20
    sample_every: int = 50
    sample_tokens: int = 64
    ckpt_every: int = 0
    keep_last: int = 0                # keep only the newest N checkpoints (0: all)
    checkpoint: bool = True
    out_dir: str | None = None        # None: out/<preset>
    resume: str | None = None
    init_from: str | None = None      # start from these weights (fresh optimizer, step 0); see gpucore.weights
    metrics: str | None = None        # None: <out_dir>/metrics.jsonl
    optimizer: str = "adamw"          # adamw | sfadamw (schedule-free AdamW: no lr decay schedule)
    master_weights: str = "fp32"      # bf16 models: fp32 master copy, or none with "sr" (stochastic rounding) / "kahan"
    keep_gelu: str = "auto"           # store the GELU outputs per layer (on), recompute them (off), or decide (auto)
    fp8_scaling: str = "adaptive"     # --dtype fp8: adaptive (last step's scale, re-cast when off), current, delayed
    cuda_graph: str = "auto"          # replay each micro-batch's forward + backward from a CUDA graph (auto: on a GPU)
    nproc: int = 0                    # start this many ranks on this machine (0: this process is the run)
    zero: int = 0                     # 1: ZeRO-1, optimizer state sharded across ranks
    dist_timeout: float = 900.0       # seconds without progress before a rank ends the job (data parallel)


# ------------------------------------------------------------------- steps ----

def train_step(model, optimizer, next_batch, grad_accum: int, lr: float, reducer=None, world_size: int = 1,
               graph=None):
    """One optimizer step over grad_accum micro-batches from next_batch(); returns (loss, norm).

    Both are 0-d fp32 arrays on the model's device (read them with float()); the loss is this
    rank's. With a reducer (data parallel), the gradient is the mean over all ranks' tokens: it
    reduces them after the last micro-batch's backward, or (reducer.overlap) during it, taking each
    layer's finished gradients as the backward hands them over.
    graph: a StepGraph of this model (gpucore/step_graph.py) runs each micro-batch's forward +
    backward (not with an overlapping reducer); the reduction and the optimizer step stay eager.
    """
    if graph is not None and reducer is not None and reducer.overlap:
        raise ValueError("train_step: a CUDA graph of the step cannot run the reducer's per-layer host hooks")
    model.zero_grad()
    total = None
    rank = reducer.comm.rank if reducer is not None else 0
    for i in range(grad_accum):
        x, y = next_batch()
        model.set_micro_batch(rank * grad_accum + i)    # the thinned dlogits' own draws (GPT2.set_micro_batch)
        scale = 1.0 / (grad_accum * x.size * world_size)
        if graph is not None:   # the graph's loss array is overwritten by its next replay: copy it
            loss = graph.forward_backward(x, y, scale)
            total = loss.copy() if total is None else total + loss
            continue
        # check_tokens=False: the loader checked the ids against the vocabulary (no host sync here)
        loss = model.forward(x, y, for_backward=True, grad_scale=scale, check_tokens=False)
        last = reducer is not None and i == grad_accum - 1
        model.backward(on_layer_done=reducer.layer_done if last else None)
        total = loss if total is None else total + loss
    if reducer is not None:
        reducer.finish()
    norm = optimizer.step(lr)
    model.end_step()
    return total / grad_accum, norm


def step_mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, world_size: int = 1):
    """Model FLOPs utilization of each GPU: tokens_per_s counts every rank's tokens, so the work
    is shared by world_size GPUs before it is set against one GPU's dense bf16 peak. None where
    the peak is unknown (the CPU, float32, an unlisted GPU)."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * world_size)


def evaluate(model, loader, steps: int) -> float:
    """Mean loss over the first `steps` batches of `loader` (reset first, as llm.c does)."""
    loader.reset()
    total = None
    for _ in range(steps):
        x, y = loader.next_batch()
        loss = model.forward(x, y, check_tokens=False)
        total = loss if total is None else total + loss
    return float(total) / steps


# ------------------------------------------------------------------ set up ----

@dataclass
class RunSetup:
    """What prepare() decided: model, backend, batch geometry, paths, and the state to resume."""
    preset: str
    cfg: object                       # GPT2Config
    device: str
    xp: object
    dtype: object
    B: int
    T: int
    total: int                        # tokens per optimizer step
    grad_accum: int
    out_dir: Path
    metrics_path: Path
    plan: dict                        # bytes of each buffer the run allocates (model.memory_plan)
    keep_gelu: bool = False           # the --keep-gelu decision (model.resolve_keep_gelu)
    fp8: str | None = None            # --dtype fp8: the scaling mode of the FP8 linears, else None
    cuda_graph: bool = False          # the --cuda-graph decision (gpucore.step_graph.resolve)
    cuda_graph_why: str = "off"       # ... in words, for the header
    start: int = 0                    # the step to continue from
    resume_arrays: dict | None = None
    resume_meta: dict | None = None
    resume_path: Path | None = None
    resume_settings: dict = field(default_factory=dict)   # fp8_resume_settings of the checkpoint
    init_flat: object = None          # --init-from: host fp32 flat weights, until the model holds them
    init_source: str | None = None    # --init-from: where they came from (gpucore.weights' description)
    dp: object = None                 # DataParallel (gpucore.distributed) when this process is one of several ranks


def prepare(args: TrainArgs, echo, dp=None) -> RunSetup:
    """Read the checkpoint (when resuming), choose config/backend/dtype and check the batch geometry."""
    from . import dtypes
    from .model import PRESETS, GPT2Config, memory_plan, resolve_keep_gelu
    arrays = meta = ckpt = None
    device, why = choose_device(args.device)
    if args.device == "auto":
        echo(f"device auto -> {device} ({why})")
    init_flat = init_source = None
    if args.resume and args.init_from:
        raise TrainError("--init-from and --resume: a resumed run continues its checkpoint's weights; "
                         "use one of them")
    if args.resume:
        arrays, meta, ckpt = read_training_checkpoint(args.resume, on_skip=echo)
        cfg = GPT2Config.from_dict(meta["config"])
        preset = meta.get("preset") or "custom"
        if args.model is not None and args.model != preset:
            raise TrainError(f"--model {args.model}: the checkpoint {ckpt} is a {preset!r} model")
        dtype = dtypes.normalize(meta["dtype"])
        fp8 = (meta.get("fp8") or {}).get("mode")
        trained = "fp8" if fp8 else dtypes.name(dtype)
        wanted = args.dtype if args.dtype in ("auto", "fp8") else dtypes.name(dtypes.normalize(args.dtype))
        if wanted not in ("auto", trained):
            raise TrainError(f"--dtype {args.dtype}: the checkpoint {ckpt} was trained in {trained}")
        device, xp, _ = resolve_backend(device)
    elif args.init_from:
        from .weights import WeightsError, read_weights
        try:
            cfg, init_flat, init_source = read_weights(args.init_from)
        except WeightsError as e:
            raise TrainError(f"--init-from: {e}") from None
        preset = next((name for name in PRESETS if _preset_config(name) == cfg), "custom")
        if args.model is not None:
            try:
                wanted = GPT2Config.from_preset(args.model)
            except ValueError as e:
                raise TrainError(str(e)) from None
            if wanted != cfg:
                raise TrainError(f"--model {args.model} ({wanted.describe()}) does not match the weights of "
                                 f"--init-from {args.init_from} ({cfg.describe()})")
            preset = args.model
        device, xp, dtype = resolve_backend(device, "bfloat16" if args.dtype == "fp8" else args.dtype)
    else:
        preset = args.model or "d12"
        try:
            cfg = GPT2Config.from_preset(preset)
        except ValueError as e:
            raise TrainError(str(e)) from None
        device, xp, dtype = resolve_backend(device, "bfloat16" if args.dtype == "fp8" else args.dtype)
    if not args.resume:
        fp8 = args.fp8_scaling if args.dtype == "fp8" else None
    if fp8:
        check_fp8(device)

    B = args.batch_size
    T = args.seq_len or min(1024, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise TrainError(f"-T {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    if fp8 and (B * T) % 16:
        raise TrainError(f"--dtype fp8: B*T = {B}*{T} must be a multiple of 16 (the FP8 GEMM's rule)")
    world = dp.world_size if dp is not None else 1
    total = args.total_batch_size or B * T * world
    if total % (B * T * world):
        ranks = f" x {world} ranks" if world > 1 else ""
        raise TrainError(f"--total-batch-size {total} is not a multiple of B*T{ranks} = {B}*{T}"
                         f"{'*' + str(world) if world > 1 else ''} = {B * T * world}")
    check_optimizer_choice(args, dtype, dp)
    if args.zero and dp is None:
        echo("--zero 1 without several ranks: nothing to shard, training as usual")
    out_dir = Path(args.out_dir or f"out/{preset}")
    if args.keep_gelu not in ("auto", "on", "off"):
        raise TrainError(f"--keep-gelu {args.keep_gelu}: expected auto, on or off")
    resume_settings = fp8_resume_settings(cfg, arrays) if fp8 else {}
    with settings.using(**resume_settings):      # a resumed FP8 run's buffers are the saved run's
        keep_gelu = resolve_keep_gelu({"auto": None, "on": True, "off": False}[args.keep_gelu], cfg, B, T, dtype,
                                      xp, master_weights=args.master_weights, fp8=fp8 or False)
        plan = memory_plan(cfg, B, T, dtype, master_weights=args.master_weights, keep_gelu=keep_gelu,
                           fp8=fp8 or False)
    try:
        cuda_graph, graph_why = step_graph.resolve(args.cuda_graph, device, data_parallel=dp is not None,
                                                   dp_overlap=settings.current().dp_overlap)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if dp is not None:
        from .distributed.parallel import plan_for
        plan = plan_for(plan, world, dp.zero)
    return RunSetup(preset=preset, cfg=cfg, device=device, xp=xp, dtype=dtype, B=B, T=T, total=total,
                    grad_accum=total // (B * T * world), out_dir=out_dir,
                    metrics_path=Path(args.metrics) if args.metrics else out_dir / "metrics.jsonl",
                    plan=plan, keep_gelu=keep_gelu, fp8=fp8, cuda_graph=cuda_graph, cuda_graph_why=graph_why,
                    start=int(meta["step"]) if meta else 0,
                    resume_arrays=arrays, resume_meta=meta, resume_path=ckpt, resume_settings=resume_settings,
                    init_flat=init_flat, init_source=init_source, dp=dp)


def check_fp8(device: str) -> None:
    """--dtype fp8 where it cannot run, as one line."""
    if device == "cuda":
        from .ops.fp8 import fp8_supported
        ok, why = fp8_supported()
        if not ok:
            raise TrainError(f"--dtype fp8: {why}")


def check_optimizer_choice(args: TrainArgs, dtype, dp) -> None:
    """--optimizer / --master-weights / --zero combinations that cannot work, as one line each."""
    from . import dtypes
    if args.optimizer not in ("adamw", "sfadamw"):
        raise TrainError(f"--optimizer {args.optimizer}: expected adamw or sfadamw")
    if args.master_weights not in ("fp32", "sr", "kahan"):
        raise TrainError(f"--master-weights {args.master_weights}: expected fp32, sr or kahan")
    if args.master_weights != "fp32" and dtype != dtypes.bfloat16:
        raise TrainError(f"--master-weights {args.master_weights}: only bf16 models drop the fp32 master "
                         f"copy (this run is {dtypes.name(dtype)})")
    if args.optimizer == "sfadamw" and args.final_lr_frac != 1.0:
        raise TrainError("--optimizer sfadamw replaces the lr decay schedule (its averaging is the schedule): "
                         "leave --final-lr-frac at 1")
    if dp is not None and dp.zero and (args.optimizer != "adamw" or args.master_weights != "fp32"):
        raise TrainError("--zero 1 shards AdamW with fp32 master weights; --optimizer sfadamw and "
                         "--master-weights sr/kahan are not sharded yet")


def _preset_config(name: str):
    from .model import GPT2Config
    try:
        return GPT2Config.from_preset(name)
    except ValueError:
        return None


def train_order(args: TrainArgs, resume_meta: dict | None) -> tuple[bool, int]:
    """(shuffle, seed) of the train loader. A resumed run continues its checkpoint's data order:
    --shuffle left out takes the checkpoint's choice, and a shuffled run keeps the seed its order
    was drawn from, as it keeps its weights. Naming the other choice than the checkpoint's is
    refused by the loader's state check, with the reason."""
    saved = (resume_meta or {}).get("data") or {}
    shuffle = args.shuffle if args.shuffle is not None else bool(saved.get("shuffle", False))
    seed = int(saved["seed"]) if shuffle and saved.get("shuffle") and "seed" in saved else args.seed
    return shuffle, seed


def make_loaders(args: TrainArgs, setup: RunSetup, echo):
    """(train loader, val loader or None); a missing default dataset says how to make it."""
    from . import data as datamod
    cfg, B, T, xp = setup.cfg, setup.B, setup.T, setup.xp
    rank, world = (setup.dp.rank, setup.dp.world_size) if setup.dp is not None else (0, 1)
    shuffle, data_seed = train_order(args, setup.resume_meta)
    try:
        train = datamod.DataLoader(args.data, B, T, split="train", xp=xp, vocab_size=cfg.vocab_size,
                                   shuffle=shuffle, seed=data_seed, process_rank=rank, num_processes=world)
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
            Bv = min(B, (min(probe.shard_tokens) - 1) // (T * world))
            if Bv < 1:
                raise datamod.DataError(f"the val split holds fewer than {world} x T + 1 tokens")
            val = datamod.DataLoader(args.data, Bv, T, split="val", xp=xp, vocab_size=cfg.vocab_size,
                                     process_rank=rank, num_processes=world)
        except datamod.DataError as e:
            echo(f"validation off: {e}")
            val = None
    return train, val


def check_output_paths(args: TrainArgs, setup: RunSetup, echo) -> None:
    """Fail now, not after the last step, if checkpoints or metrics cannot be written; remove the
    temporary files of saves that were killed mid-write."""
    if args.checkpoint or args.metrics is None:
        check_output_dir(setup.out_dir)
    check_metrics_file(setup.metrics_path)
    stale = remove_stale_temp_files(setup.out_dir, CHECKPOINT_GLOB)
    stale += remove_stale_temp_files(setup.metrics_path.parent, setup.metrics_path.name)
    for p in stale:
        echo(f"removed {p} (the temporary file of a save that was killed)")


def saved_fp8_lm_head(cfg, arrays) -> bool | None:
    """Whether an FP8 checkpoint's run had the FP8 LM head: its scaling state holds 12 tensors per
    layer, plus 3 for the head. None when the checkpoint has no FP8 state."""
    if arrays is None or "fp8_scale" not in arrays:
        return None
    return len(arrays["fp8_scale"]) == 12 * cfg.num_layers + 3


def fp8_resume_settings(cfg, arrays) -> dict:
    """The settings a resumed FP8 run keeps from its checkpoint, whatever they say now: the LM head's
    precision (the scaling state's size differs; a mismatch used to stop the resume) and fch's format
    (it changes the arithmetic: fch as E4M3 became the default in the 72nd session, and a run saved
    before resumes bit for bit, with fch in bf16). {} for a fresh run or one without FP8 state."""
    head = saved_fp8_lm_head(cfg, arrays)
    # a run that kept fch as E4M3 (fp8_linear.fch_in_e4m3) saves fch's delayed scales beside the linears'
    return {} if head is None else {"fp8_lm_head": head, "fp8_fch_e4m3": "fp8_fch_scale" in arrays}


def build_model(args: TrainArgs, setup: RunSetup, echo=print):
    """(model, optimizer, rng), restored from the checkpoint when resuming."""
    from .fp8_linear import fch_in_e4m3
    from .model import GPT2
    from .optim import AdamW, ScheduleFreeAdamW
    resuming = setup.resume_arrays is not None
    initialised = setup.init_flat is not None
    # A resumed FP8 run keeps the LM head and fch's format it was saved with (fp8_resume_settings).
    saved = setup.resume_settings                 # {} unless resuming an FP8 checkpoint
    fch8_now = fch_in_e4m3(setup.fp8)
    with settings.using(**saved):
        fch8_saved = fch_in_e4m3(setup.fp8)   # False whatever was saved unless the scaling is adaptive
        model = GPT2(setup.cfg, xp=setup.xp, dtype=setup.dtype,
                     seed=None if resuming or initialised else args.seed, keep_gelu=setup.keep_gelu, fp8=setup.fp8)
    head = saved.get("fp8_lm_head")
    if head is not None and head != settings.current().fp8_lm_head:
        echo(f"resuming with the FP8 LM head {'on' if head else 'off'}, as the checkpoint was saved "
             f"(settings.fp8_lm_head says {'on' if settings.current().fp8_lm_head else 'off'})")
    if fch8_saved != fch8_now:
        fmt = lambda e4m3: "E4M3" if e4m3 else "bf16"
        echo(f"resuming with fch (the GELU input kept for the backward) in {fmt(fch8_saved)}, as the checkpoint "
             f"was saved (settings.fp8_fch_e4m3 says {fmt(fch8_now)})")
    model.allocate_grads()
    model.allocate_activations(setup.B, setup.T)
    kw = dict(betas=(args.beta1, args.beta2), weight_decay=args.weight_decay, max_grad_norm=args.grad_clip or None)

    def make():
        if args.optimizer == "sfadamw":
            return ScheduleFreeAdamW(model, warmup_steps=args.warmup, master_weights=args.master_weights,
                                     seed=args.seed, **kw)
        return AdamW(model, master_weights=args.master_weights, seed=args.seed, **kw)
    opt = setup.dp.optimizer(model, make, **kw) if setup.dp is not None else make()
    rng = np.random.default_rng(args.seed)
    if initialised:
        model.load_flat(setup.init_flat)
        setup.init_flat = None            # the model holds them now: let the host copy go
    if resuming:
        arrays, meta = setup.resume_arrays, setup.resume_meta
        model.load_flat(arrays["params"])
        try:
            opt.load_state(arrays, meta["optimizer"])
            if model.fp8 is not None:
                model.fp8.scaling.load_state({**meta["fp8"], "scale": arrays["fp8_scale"],
                                              "history": arrays["fp8_history"]})
                fch = model.fp8.fch_scaling
                if fch is not None and "fp8_fch_scale" in arrays:   # (a checkpoint without: fresh fch scales)
                    fch.load_state({**meta["fp8"]["fch"], "scale": arrays["fp8_fch_scale"],
                                    "history": arrays["fp8_fch_history"]})
            if meta.get("rng") is not None:
                rng.bit_generator.state = meta["rng"]
            model.set_step(setup.start)       # the thinned dlogits draw as the run would have
        except (KeyError, ValueError, TypeError) as e:
            raise TrainError(f"{setup.resume_path}: cannot resume from this checkpoint ({e})") from None
        setup.resume_arrays = None        # the model holds them now: let the host copy go
    return model, opt, rng


def restore_data_position(setup: RunSetup, train_loader, echo) -> None:
    meta = setup.resume_meta
    if meta is not None and meta.get("data") is not None:
        try:
            note = train_loader.load_state_dict(meta["data"], remap_processes=True)
            if note:
                echo(note)
        except (KeyError, ValueError, TypeError) as e:
            raise TrainError(f"{setup.resume_path}: cannot resume from this checkpoint ({e})") from None


def print_header(args, setup: RunSetup, model, train_loader, val_loader, echo) -> None:
    from . import dtypes
    cfg, n = setup.cfg, model.num_parameters
    echo(f"gpucore train | model {setup.preset}: {cfg.describe()} | {n:,} parameters")
    echo(f"device {setup.device}{' (' + gpu_name() + ')' if setup.device == 'cuda' else ''} | "
         f"dtype {dtypes.name(setup.dtype)}{f' + FP8 linears ({setup.fp8} scaling)' if setup.fp8 else ''} | B={setup.B} T={setup.T} | {setup.total:,} tokens/step "
         f"(grad accum {setup.grad_accum}) | steps {args.steps}"
         + (f" | resumed at step {setup.start} from {setup.resume_path}" if setup.resume_path else ""))
    if setup.init_source:
        echo(f"initialised from {setup.init_source} (fresh optimizer, step 0)")
    name = {"adamw": "AdamW", "sfadamw": "schedule-free AdamW"}[args.optimizer]
    weights = {"fp32": "", "sr": " | bf16 weights, no fp32 master (stochastic rounding)",
               "kahan": " | bf16 weights, no fp32 master (Kahan compensation)"}[args.master_weights]
    echo(f"{name} lr {args.lr:g} warmup {args.warmup} final lr frac {args.final_lr_frac:g} betas "
         f"({args.beta1:g}, {args.beta2:g}) weight decay {args.weight_decay:g} grad clip {args.grad_clip:g}{weights}")
    if args.warmup == 0 and setup.resume_path is None and not setup.init_source and args.steps > 10:
        # measured, not assumed: tools/notes/fp8.md, 71st and 72nd sessions (36 seeds a mode)
        echo("note: no lr warmup (--warmup 0, the default): d12 B=64 at lr 3e-4 took one-step loss spikes "
             "at steps 6-13 in 9 of 36 seeds in bf16, and in FP8; with --warmup 100 none were left but the "
             "data's own (README: Training, FP8)")
    echo(f"data: train {train_loader.num_tokens:,} tokens ({train_loader.num_batches} batches/epoch"
         + (f", shuffled per epoch from seed {train_loader.seed})" if train_loader.shuffle else ", in order)")
         + (f", val {val_loader.num_tokens:,} tokens ({val_loader.B} rows x {setup.T})" if val_loader else ""))
    if setup.dp is not None:
        echo(setup.dp.describe() + f" | {setup.B * setup.T:,} tokens per rank per micro-batch")
    echo(format_plan(setup.plan) + (" (per rank)" if setup.dp is not None else "")
         + f" | GELU outputs {'kept per layer' if setup.keep_gelu else 'recomputed in the backward'}"
         + f" | CUDA graph {setup.cuda_graph_why}")
    if setup.device == "cpu" and n > 20_000_000:
        echo("note: the CPU (NumPy reference) backend is slow for this model; try --model tiny")


# --------------------------------------------------------------------- run ----

def run(args: TrainArgs, echo=print) -> dict:
    """Train as `args` says; returns {"losses": [...], "val_losses": {step: loss}, "checkpoints": [...],
    "step": final step, "peak_gpu_bytes": ..., "already_finished": bool}.

    Raises TrainError for user-caused problems and TrainInterrupted on Ctrl-C.
    """
    from .data import DataError
    from .distributed import DistributedError
    plan = dp = None
    try:
        dp = start_data_parallel(args)
        if dp is not None and not dp.is_main:
            echo = _silent
        setup = prepare(args, echo, dp)
        plan = setup.plan
        if setup.start >= args.steps:
            echo(f"already finished: step {setup.start} of {args.steps}; raise --steps to train longer")
            return {"losses": [], "val_losses": {}, "checkpoints": [], "step": setup.start,
                    "peak_gpu_bytes": None, "already_finished": True}
        if setup.device == "cpu":
            check_host_memory(setup.plan)
        else:
            check_gpu_memory(setup.plan)
        train_loader, val_loader = make_loaders(args, setup, echo)
        if dp is None or dp.is_main:
            check_output_paths(args, setup, echo)
        model, opt, rng = build_model(args, setup, echo)
        restore_data_position(setup, train_loader, echo)
        print_header(args, setup, model, train_loader, val_loader, echo)
        with open_metrics(args, setup) as log:
            return Trainer(args, setup, model, opt, rng, train_loader, val_loader, log, echo).loop()
    except (TrainError, CheckpointError, DataError, DistributedError) as e:
        raise _on_rank(dp, str(e)) from None
    except oom_error_types():
        raise _on_rank(dp, oom_message(plan)) from None
    except OSError as e:         # a disk that filled up or went read-only mid-run
        where = f"{e.filename}: " if e.filename else ""
        raise _on_rank(dp, f"{where}{os_reason(e)}") from None
    finally:
        if dp is not None:
            dp.close()


def start_data_parallel(args: TrainArgs):
    """DataParallel when this process is one rank of several (mpirun / srun / --nproc), else None."""
    from .distributed.parallel import DataParallel
    if args.zero not in (0, 1):
        raise TrainError(f"--zero {args.zero}: only 0 (off) and 1 (ZeRO-1: optimizer state sharded) exist")
    device, _ = choose_device(args.device)
    return DataParallel.start(device, zero=args.zero, timeout=args.dist_timeout)


def _on_rank(dp, message: str) -> TrainError:
    """The error, naming the rank when there are several (each rank reports its own)."""
    if dp is not None and dp.world_size > 1 and not message.startswith("rank "):
        message = f"rank {dp.rank}: {message}"
    return TrainError(message)


def _silent(*args, **kwargs):
    """The echo of ranks other than 0."""


@contextlib.contextmanager
def open_metrics(args: TrainArgs, setup: RunSetup):
    """A log(record) function appending JSON lines to the metrics file.

    A fresh run starts the file anew; a resumed one first drops the rows past
    its step, so each step appears once however often the run was interrupted.
    """
    from . import dtypes
    path = setup.metrics_path
    if setup.dp is not None and not setup.dp.is_main:      # rank 0 writes the metrics
        yield _silent
        return
    if setup.resume_path is not None:
        trim_metrics(path, setup.start)
    with open(path, "a" if setup.resume_path is not None else "w") as f:
        def log(rec):
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if setup.resume_path is None:
            log({"event": "start", "preset": setup.preset, "config": setup.cfg.to_dict(),
                 "dtype": dtypes.name(setup.dtype), "device": setup.device, "args": asdict(args),
                 "parameters": setup.cfg.num_parameters, "init_from": args.init_from,
                 "init_source": setup.init_source})
        else:
            log({"event": "resume", "step": setup.start, "checkpoint": str(setup.resume_path),
                 "args": asdict(args)})
        yield log


@contextlib.contextmanager
def stop_after_step_on_sigint():
    """While active, a first SIGINT only asks the loop to stop after the current step (flag["stop"]);
    a second one raises KeyboardInterrupt at once. Only the main thread can take signals."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_sigint(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        # os.write, not print: a handler can run in the middle of another print to the same stream
        with contextlib.suppress(OSError):
            os.write(2, b"\nCtrl-C: stopping after this step (press again to stop at once)\n")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:   # None: the previous handler was not set from Python; Python's own is the safe default
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _bar(done: int, total: int, width: int = 20) -> str:
    k = int(width * done / max(1, total))
    return "[" + "#" * k + "-" * (width - k) + "]"


def _eta(seconds: float) -> str:
    """A duration as the progress line shows it: 45s, 12m05s, 3h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class Trainer:
    """The loop of one run over already-built parts (run() assembles them)."""
    args: TrainArgs
    setup: RunSetup
    model: object
    opt: object
    rng: object
    train_loader: object
    val_loader: object
    log: object
    echo: object

    def __post_init__(self):
        s = self.setup
        self.result = {"losses": [], "val_losses": {}, "checkpoints": [], "step": s.start,
                       "peak_gpu_bytes": None, "already_finished": False}
        self.fpt = s.cfg.flops_per_token(s.T)
        self.peak = peak_flops(s.device, s.dtype)     # one GPU's (step_mfu shares the tokens among the ranks)
        self.dp = s.dp
        self.is_main = self.dp is None or self.dp.is_main
        self.can_sample = self.args.sample_every and s.cfg.vocab_size == 50257 and self.is_main
        self.stop_agreed = False          # data parallel: some rank was asked to stop (agreed each step)
        self.step_times: list[float] = []  # seconds of each step of this run (the ETA's basis)
        self.graph = (step_graph.StepGraph(self.model, strict=self.args.cuda_graph == "on", echo=self.echo)
                      if s.cuda_graph else None)
        self.saved_step = s.start if s.resume_path is not None else None
        self.saved_path = s.resume_path
        # state after the last completed step: what a Ctrl-C checkpoint must hold even when the
        # interrupted step had already taken micro-batches from the loader
        self.after_step = (s.start, self.train_loader.state_dict(), self.rng.bit_generator.state)

    def loop(self) -> dict:
        args = self.args
        with stop_after_step_on_sigint() as flag:
            try:
                for step in range(self.setup.start, args.steps):
                    if self.should_stop(flag):
                        raise KeyboardInterrupt
                    self.step(step, flag)
                if self.should_stop(flag):   # Ctrl-C during the last step: skip the final val and sample
                    raise KeyboardInterrupt
                if self.val_loader is not None:
                    self.validate(args.steps)
                if self.can_sample:
                    self.sample(args.steps)
            except KeyboardInterrupt:
                self.interrupted()
        if self.setup.device == "cuda":
            self.result["peak_gpu_bytes"] = compressible.device_bytes()
        self.log({"event": "end", "step": self.result["step"], "peak_gpu_bytes": self.result["peak_gpu_bytes"]})
        return self.result

    def should_stop(self, flag) -> bool:
        """Ctrl-C seen (with several ranks: by any rank, as agreed after the last step)."""
        return self.stop_agreed if self.dp is not None else flag["stop"]

    def step(self, step: int, flag=None) -> None:
        """Validate/sample when due, take optimizer step step+1, log it, checkpoint when due."""
        from .optim import lr_schedule
        args, s = self.args, self.setup
        if self.val_loader is not None and step % args.val_every == 0:
            self.validate(step)
        if self.can_sample and step > s.start and step % args.sample_every == 0:
            self.sample(step)
        schedule_free = args.optimizer == "sfadamw"     # its warmup is inside the optimizer; no decay
        lr = args.lr if schedule_free else lr_schedule(step, args.lr, args.steps, args.warmup, args.final_lr_frac)
        t0 = time.perf_counter()
        dp = self.dp
        if dp is not None:
            dp.watchdog.beat(f"the start of step {step + 1}")
        try:
            loss_d, norm_d = train_step(self.model, self.opt, self.train_loader.next_batch, s.grad_accum, lr,
                                        reducer=dp.reducer if dp is not None else None,
                                        world_size=dp.world_size if dp is not None else 1, graph=self.graph)
        except step_graph.GraphCaptureError as e:        # --cuda-graph on: one line, not a traceback
            raise TrainError(str(e)) from None
        loss, norm = float(loss_d), float(norm_d)      # syncs: the step is done
        if schedule_free:
            lr = self.opt.last_lr                       # the step's lr after the optimizer's warmup
        if dp is not None:      # the global mean loss, and whether any rank was asked to stop
            loss, self.stop_agreed = dp.agree(loss, bool(flag and flag["stop"]))
            dp.watchdog.beat(f"step {step + 1}")
        if not (np.isfinite(loss) and np.isfinite(norm)):
            self.stop_non_finite(step + 1, loss, norm)
        dt = time.perf_counter() - t0
        done = step + 1
        tps = s.total / dt
        mfu = step_mfu(self.fpt, tps, self.peak, dp.world_size if dp is not None else 1)
        self.result["losses"].append(loss)
        self.result["step"] = done
        self.step_times.append(dt)
        # the first step of a run compiles kernels and fills caches: leave it out of the estimate
        recent = self.step_times[1:] or self.step_times
        eta = _eta(sum(recent) / len(recent) * (args.steps - done))
        self.echo(f"step {done:>5d}/{args.steps} {_bar(done, args.steps)} ETA {eta} | loss {loss:.6f} | "
                  f"norm {norm:.4f} | lr {lr:.2e} | {dt * 1e3:.1f} ms | {tps:,.0f} tok/s | MFU "
                  + (f"{100 * mfu:.1f}%" if mfu is not None else "-"))
        self.log({"step": done, "loss": loss, "grad_norm": norm, "lr": lr, "ms": dt * 1e3,
                  "tokens_per_s": tps, "mfu": mfu})
        # only now is step `done` complete, its metrics row included
        self.after_step = (done, self.train_loader.state_dict(), self.rng.bit_generator.state)
        if done == s.start + 1 and s.device == "cuda":
            self.result["peak_gpu_bytes"] = compressible.device_bytes()
            self.echo(f"GPU memory after the first step: {self.result['peak_gpu_bytes'] / 2**30:.2f} GiB held by "
                      "CuPy's memory pool (its high-water mark) and the compressible buffers")
        if args.checkpoint and ((args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps):
            self.save()

    def save(self) -> Path:
        """Checkpoint the last completed step, then drop checkpoints beyond --keep-last."""
        done, data_state, rng_state = self.after_step
        path = checkpoint_path(self.setup.out_dir, done)
        if not self.is_main:     # rank 0 writes; with ZeRO-1 the others take part in gathering the state
            if self.dp.zero:
                self.opt.state_arrays()
            self.saved_step, self.saved_path = done, path
            return path
        save_training_checkpoint(path, self.model, self.opt, step=done, preset=self.setup.preset,
                                 data_state=data_state, rng_state=rng_state, args=self.args)
        self.saved_step, self.saved_path = done, path
        self.result["checkpoints"].append(str(path))
        removed = prune_checkpoints(self.setup.out_dir, self.args.keep_last, done)
        self.echo(f"step {done:>5d} | checkpoint {path}"
                  + (f" (removed {', '.join(p.name for p in removed)})" if removed else ""))
        return path

    def stop_non_finite(self, done: int, loss: float, norm: float):
        """A NaN or inf loss or gradient norm ends the run with one line (TrainError), before this
        step is logged as done or saved: the update has already run (a NaN norm makes AdamW's clip
        NaN, so the weights are NaN too), so only the last checkpoint is worth resuming from. With
        several ranks, each sees the same agreed loss and global norm, so all stop at the same step."""
        self.log({"event": "non-finite", "step": done, "loss": str(loss), "grad_norm": str(norm)})
        if self.saved_path is not None:
            where = (f"the last checkpoint is step {self.saved_step}: resume with --resume {self.saved_path} "
                     f"(or an earlier checkpoint if the loss was already climbing there) and a lower --lr "
                     f"or a longer --warmup, or it will happen again")
        else:
            where = ("no checkpoint was written before it (--ckpt-every N keeps one every N steps); "
                     "a lower --lr or a longer --warmup may avoid it")
        raise TrainError(f"step {done}: loss {loss}, gradient norm {norm}: training stopped and this step "
                         f"was not saved; {where}")

    def interrupted(self):
        """Ctrl-C: checkpoint the last completed step if it is not on disk yet, then raise TrainInterrupted."""
        done = self.after_step[0]
        # AdamW counts its updates: a different count means the interrupted step had begun
        # changing the weights, and they no longer match any completed step
        consistent = self.opt.step_count == done
        self.log({"event": "interrupted", "step": done})
        if not self.args.checkpoint:
            note = "no checkpoint (--no-checkpoint)"
        elif done == self.setup.start:
            note = "no step completed since the start" + (", nothing new to save" if self.saved_path else "")
        elif self.saved_step == done:
            note = f"checkpoint {self.saved_path}"
        elif not consistent:
            note = "the weights were mid-update, not saved" + (
                f"; the last checkpoint is {self.saved_path}" if self.saved_path else "")
        else:
            try:
                note = f"saved checkpoint {self.save()}"
            except KeyboardInterrupt:
                note = "the save was interrupted" + (
                    f"; the last checkpoint is {self.saved_path}" if self.saved_path else "")
        ckpt = self.saved_path if self.args.checkpoint else None
        raise TrainInterrupted(f"interrupted after step {done} of {self.args.steps}: {note}", done, ckpt)

    def eval_weights(self):
        """The weights to evaluate and sample with: schedule-free AdamW's average x, else the model's own."""
        return self.opt.averaged() if hasattr(self.opt, "averaged") else contextlib.nullcontext()

    def validate(self, step: int) -> None:
        with self.eval_weights():
            vl = evaluate(self.model, self.val_loader, min(self.args.val_steps, self.val_loader.num_batches))
        if self.dp is not None:          # each rank evaluated its slice of the same batches
            vl = self.dp.mean(vl)
        self.result["val_losses"][step] = vl
        self.echo(f"step {step:>5d} | val loss {vl:.6f}")
        self.log({"step": step, "val_loss": vl})

    def sample(self, step: int) -> None:
        from . import tokenizer
        from .sample import generate
        with self.eval_weights():
            ids = generate(self.model, [tokenizer.EOT], self.args.sample_tokens, temperature=1.0, top_k=40,
                           rng=self.rng)
        text = tokenizer.decode(ids)
        self.echo(f"step {step:>5d} | sample: {text!r}")
        self.log({"step": step, "sample": text})
