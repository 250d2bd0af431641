"""Probe: fch kept as E4M3 (settings.fp8_fch_e4m3) -- does its delayed scale saturate, and when?

Runs `gpucore train` (arguments after the script name, as the CLI takes them) with GPT2.end_step
wrapped: after each step it prints, for the layers where something happened, fch's amax this step
(cuBLASLt's amax of D) against the largest value its scale could hold (448 / scale), the saturated
bytes (|q| = 448) and the zero bytes in the kept fch8 -- the last micro-batch's, read before the
scales move.

Run (GPU):  PYTHONPATH=. python3 tools/probes/fch_saturation.py --model d12 -B 64 --steps 14 --dtype fp8 ...
"""
import sys

import numpy as np

from gpucore import model as model_mod
from gpucore.cli import main

_orig = model_mod.GPT2.end_step
_step = [0]


def end_step(self):
    _step[0] += 1
    fs = getattr(self.fp8, "fch_scaling", None) if self.fp8 is not None else None
    if fs is not None:
        amax, scale = fs.amax.get(), fs.scale.get()
        fch = self.acts.fch
        rows = []
        for l in range(fch.shape[0]):
            q = fch[l].reshape(-1) & 0x7F
            sat, zero = int((q == 0x7E).sum()), float((q == 0).mean())
            cap = 448.0 / scale[l]
            rows.append(f"L{l}: amax {amax[l]:.3g} cap {cap:.3g} sat {sat} zero {zero:.3f}")
        worst = max(range(len(rows)), key=lambda l: amax[l] * scale[l])
        print(f"[fch step {_step[0]}] worst {rows[worst]} | all sat {sum(int(r.split('sat ')[1].split()[0]) for r in rows)}",
              flush=True)
    return _orig(self)


model_mod.GPT2.end_step = end_step
sys.argv = ["gpucore", "train", *sys.argv[1:]]
main()
