"""AdamW over the model's flat parameter buffer, the learning-rate schedule, gradient clipping.

One optimizer step is two kernel launches however many tensors the model has
(llm.c's design): grad_norm over the flat gradient buffer (deterministic
global L2 norm, left on the device), then adamw_update over the flat fp32
buffers, which applies the clip scale min(1, max_norm / (norm + 1e-6)) inside
the kernel (no host sync) and weight decay only on the element ranges of the
matrices (decay_spans from the parameter specs).

Mixed precision: with bf16 parameters the optimizer owns fp32 master weights
(initialised from the bf16 parameters, as llm.c does) and AdamW writes the bf16
working copy in the same pass (params_lowp). With fp32 parameters the
parameters are the master weights. m and v are always fp32.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes
from .ops.adamw import adamw_update, grad_norm
from .ops.cast import astype


def lr_schedule(step: int, max_lr: float, total_steps: int, warmup_steps: int = 0,
                final_lr_frac: float = 1.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to a fraction.

    llm.c's get_learning_rate: lr*(step+1)/warmup during warmup, then
    min_lr + 0.5*(1 + cos(pi * progress)) * (lr - min_lr) with min_lr = lr * final_lr_frac.
    final_lr_frac=1.0 is a constant learning rate after warmup.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    min_lr = max_lr * final_lr_frac
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


class AdamW:
    """AdamW on a gpucore.model.GPT2 (its flat params / grads).

    opt = AdamW(model, weight_decay=0.1, max_grad_norm=1.0)
    norm = opt.step(lr)        # 0-d fp32 array on the model's device: the pre-clip grad norm
    """

    def __init__(self, model, *, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 max_grad_norm: float | None = 1.0):
        self.model = model
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        self.decay_spans = model.decay_spans()
        xp, n = model.xp, model.num_parameters
        self.m = xp.zeros(n, dtype=np.float32)
        self.v = xp.zeros(n, dtype=np.float32)
        flat = model.params.flat()
        self.master = None if flat.dtype == dtypes.float32 else astype(flat, np.float32)
        self.step_count = 0                     # updates taken so far (AdamW's t is step_count)

    @property
    def master_params(self):
        """The fp32 weights AdamW updates (the model's own params in fp32 mode)."""
        return self.master if self.master is not None else self.model.params.flat()

    def step(self, lr: float):
        """One AdamW update from model.grads; returns the global gradient norm (before clipping)."""
        model = self.model
        if model.grads is None:
            raise RuntimeError("step: the model has no gradients (run forward/backward first)")
        grads = model.grads.flat()
        norm = grad_norm(grads)
        self.step_count += 1
        adamw_update(self.master_params, grads, self.m, self.v, lr=float(lr), step=self.step_count,
                     beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay,
                     decay_spans=self.decay_spans, grad_norm=norm if self.max_grad_norm else None,
                     max_grad_norm=self.max_grad_norm,
                     params_lowp=model.params.flat() if self.master is not None else None)
        return norm

    # ------------------------------------------------------------ state

    def state_arrays(self) -> dict:
        """The optimizer's arrays (on the model's device) for a checkpoint."""
        out = {"m": self.m, "v": self.v}
        if self.master is not None:
            out["master"] = self.master
        return out

    def state_meta(self) -> dict:
        return {"step": self.step_count, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "max_grad_norm": self.max_grad_norm}

    def load_state(self, arrays: dict, meta: dict):
        """Restore m, v, master and the step count (arrays may be NumPy; copied to the device)."""
        xp = self.model.xp
        for name in ("m", "v") + (("master",) if self.master is not None else ()):
            if name not in arrays:
                raise ValueError(f"optimizer state: {name!r} missing from the checkpoint")
            src = arrays[name]
            dst = getattr(self, name)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"optimizer state: {name!r} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst[...] = xp.asarray(np.asarray(src, dtype=np.float32) if isinstance(src, np.ndarray) else src)
        self.step_count = int(meta["step"])
