"""Probe: our causal attention (forward and backward, production path) against PyTorch's
scaled_dot_product_attention backends -- cuDNN (the engine llm.c's attention runs on), FLASH
(FlashAttention-2) and EFFICIENT -- at the d12 shape (B=64 NH=12 T=1024 hd=64, bf16) and a
d48-like one (B=16 NH=25). Same values in both (one float32 draw, each side rounds it to bf16),
timed in alternation in one process (medians of 9 rounds x 10 calls), TFLOP/s counted as `gpucore
bench attention` does (forward 4 B NH T^2 hd / 2, backward 2.5x that).

Why: tells how far the state of the art on this GPU is from our kernels at the shapes issue 15 and
16 train, i.e. what the attention lever can still give. PyTorch is a test oracle on the device
machine only; the package never imports it.

Each backend runs on the layout it is given two ways: q, k, v as strided views of the packed
(B, T, 3, NH, hd) qkv (what llm.c hands cuDNN) and as contiguous (B, NH, T, hd) tensors; a backend
that rejects one is reported and skipped. Backward calls are torch.autograd.grad over a retained
graph: only the backward kernels run (FA2's dq accumulation and conversion included).
Run:  PYTHONPATH=. python3 tools/probes/attention_vs_torch.py [--once]
--once: the d12 shape only, each side's forward and backward once and nothing timed: for a profiler
(ncu --section LaunchStats ... shows each backend's grid, block, registers and shared memory).
"""
import sys
import math

import cupy as cp
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import gpucore
from gpucore.bench import time_interleaved
from gpucore.ops import attention as attn

T, hd = 1024, 64
rng = np.random.default_rng(0)
BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))

print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")


def torch_layouts(qkv32, B, NH):
    """{layout name: (q, k, v)} bf16 leaf tensors requiring grad, in the (B, NH, T, hd) view torch wants."""
    packed = torch.from_numpy(qkv32).cuda().to(torch.bfloat16).view(B, T, 3, NH, hd)
    views = {}
    strided = packed.clone().requires_grad_(True)
    views["packed"] = (strided, tuple(strided[:, :, i].transpose(1, 2) for i in range(3)))
    contig = [packed[:, :, i].transpose(1, 2).contiguous().requires_grad_(True) for i in range(3)]
    views["BNHThd"] = (None, tuple(contig))
    return views


def compare(name, ours, theirs):
    ours = ours.astype(np.float32)
    err = np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30)
    print(f"    {name}: max |ours - torch| / max |torch| = {err:.2e}")


once = "--once" in sys.argv
for B, NH in ((64, 12),) if once else ((64, 12), (16, 25)):
    C = NH * hd
    qkv32 = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout32 = rng.standard_normal((B, T, C)).astype(np.float32)
    qkv = cp.asarray(qkv32.astype(gpucore.bfloat16))
    dout = cp.asarray(dout32.astype(gpucore.bfloat16))
    out, lse = gpucore.attention_forward(qkv, NH)
    dqkv = cp.empty_like(qkv)
    gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv)
    cp.cuda.get_current_stream().synchronize()
    ours_out = cp.asnumpy(out).astype(np.float32)
    ours_dq = cp.asnumpy(dqkv).astype(np.float32).reshape(B, T, 3, NH, hd)

    rows = [("gpucore forward", lambda: gpucore.attention_forward(qkv, NH, out=out, lse=lse), "fwd"),
            ("gpucore backward", lambda: gpucore.attention_backward(dout, qkv, out, lse, NH, dqkv), "bwd")]
    tdout = torch.from_numpy(dout32).cuda().to(torch.bfloat16).view(B, T, NH, hd).transpose(1, 2)
    print(f"B={B} NH={NH} T={T} hd={hd}")
    for layout, (leaf, (q, k, v)) in torch_layouts(qkv32, B, NH).items():
        leaves = (leaf,) if leaf is not None else (q, k, v)
        for bname, backend in BACKENDS:
            label = f"{bname} [{layout}]"
            try:
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                    grads = torch.autograd.grad(o, leaves, tdout, retain_graph=True)
                torch.cuda.synchronize()
            except Exception as e:   # a backend that does not take this layout / GPU
                print(f"  {label}: not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
            if once:
                continue
            print(f"  {label}: checked against ours")
            compare("out", ours_out, o.detach().transpose(1, 2).reshape(B, T, C).float().cpu().numpy())
            g = (grads[0].view(B, T, 3, NH, hd) if leaf is not None
                 else torch.stack([x.transpose(1, 2) for x in grads], dim=2))
            compare("dqkv", ours_dq, g.float().cpu().numpy())

            def fwd(q=q, k=k, v=v, backend=backend):
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

            def bwd(o=o, leaves=leaves):
                torch.autograd.grad(o, leaves, tdout, retain_graph=True)

            rows += [(f"{label} forward", fwd, "fwd"), (f"{label} backward", bwd, "bwd")]
    if once:
        break
    ms = time_interleaved([f for _, f, _ in rows], rounds=9)
    fwd_flops = 4.0 * B * NH * T * T * hd / 2
    for (name, _, kind), t in zip(rows, ms):
        flops = fwd_flops * (2.5 if kind == "bwd" else 1.0)
        print(f"  {name:<34} {t:7.3f} ms  {flops / t / 1e9:6.1f} TFLOP/s")
    del rows
    torch.cuda.empty_cache()
