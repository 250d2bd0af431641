"""Evaluation: loss/perplexity over token shards, HellaSwag (llm.c's way), llm.c's debug state.

- evaluate_loss(model, path, B, T): the mean loss over llm.c token shards (gpucore.data's
  DataLoader; a directory means its val split), perplexity = exp(loss).
- HellaSwag, completion style as llm.c's dev/data/hellaswag.py and llmc/dataloader.h (EvalLoader):
  each candidate row is context + ending; only the ending's tokens are scored (the last context
  token predicts the first ending token); `acc` picks the ending with the lowest summed loss,
  `acc_norm` the lowest mean loss (llm.c's C EvalLoader reports the mean one). Input: the
  HellaSwag jsonl ("ctx", "endings", "label"; each ending encoded as " " + ending) or llm.c's
  binary eval file (hellaswag_val.bin, written by llm.c's dev/data/hellaswag.py through
  data_common.write_evalfile):

      header   256 x int32: [0] magic 20240522, [1] version 1, [2] num_examples,
                            [3] longest_example_bytes
      examples a stream of uint16: <START_EXAMPLE 65535> <EXAMPLE_BYTES> <EXAMPLE_INDEX> <LABEL>
               <NUM_COMPLETIONS> <NUM_CONTEXT> context tokens...
               then per completion <NUM_COMPLETION> completion tokens...
               (EXAMPLE_BYTES counts the whole example, its first two fields included)

- llm.c's debug state (gpt2_124M_debug_state.bin, written by llm.c's train_gpt2.py write_state,
  read by test_gpt2.c / test_gpt2.cu):

      header   256 x int32: [0] magic 20240327, [1] version 2, [2] B, [3] T
      x        B*T int32;  y  B*T int32
      logits   B*T*V fp32 (V = 50257, not padded)
      loss     1 fp32
      grads    every parameter in llm.c's order, fp32; wte's rows padded to Vp with zeros
               (version 2: "1 -> 2 for padded vocab changes")

  check_debug_state runs the fp32 forward/backward on (x, y) and compares logits (first V
  columns), loss and each parameter gradient with test_gpt2.c's tolerances (or test_gpt2.cu's
  fp32 ones).

Commands: `eval_command` ("gpucore eval") and `check_debug_state_command`
("gpucore check-debug-state"); gpucore.cli registers them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

EVAL_MAGIC = 20240522
EVAL_VERSION = 1
START_EXAMPLE = 0xFFFF
STATE_MAGIC = 20240327
STATE_VERSION = 2
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMC_VOCAB = 50257

# Tolerances, absolute per element (as llm.c's tests):
# "c": test_gpt2.c (CPU fp32): logits |diff| < 1e-2, loss |diff| < 1e-2, grads |diff| <= 2e-2.
# "cu": test_gpt2.cu built with ENABLE_FP32: logits |diff| < 1e-3, grads |diff| <= 1e-6 +
#       0.079*|ref|; its step-0 loss is not compared directly (1e-5 on the rounded step losses).
TOLERANCES = {
    "c": dict(logits=1e-2, loss=1e-2, grad_abs=2e-2, grad_rel=0.0),
    "cu": dict(logits=1e-3, loss=1e-5, grad_abs=1e-6, grad_rel=0.079),
}


class EvalError(ValueError):
    """A file a user gave is missing, truncated or in the wrong format (one line)."""


def _host(a):
    from . import runtime
    return a.get() if runtime.is_gpu_array(a) else np.asarray(a)


# ------------------------------------------------------------------ loss ----

def evaluate_loss(model, path, B: int, T: int, max_batches: int | None = None) -> dict:
    """Mean loss over llm.c token shards: {loss, perplexity, tokens, batches, B, T}.

    path: a .bin file (used as is), a directory (its val split, "*_val*.bin") or a glob.
    Batches follow gpucore.data.DataLoader (llm.c's): from the first batch of the first shard,
    one pass over every shard (max_batches caps it). When a shard holds fewer than B*T+1
    tokens, fewer rows are used (as the training loop's validation does).
    """
    from . import data as datamod
    cfg, xp = model.config, model.xp
    if T < 1 or T > cfg.max_seq_len:
        raise EvalError(f"-T {T}: must be in [1, the model's max_seq_len {cfg.max_seq_len}]")
    if B < 1:
        raise EvalError(f"-B {B}: must be >= 1")
    if max_batches is not None and max_batches < 1:
        raise EvalError(f"--max-batches {max_batches}: must be >= 1")
    p = os.fspath(path)
    split = "val" if os.path.isdir(p) or "{split}" in p else None
    try:
        probe = datamod.DataLoader(p, 1, T, split=split, vocab_size=cfg.vocab_size)
        Bv = min(B, (min(probe.shard_tokens) - 1) // T)
        loader = datamod.DataLoader(p, Bv, T, split=split, xp=xp, vocab_size=cfg.vocab_size)
    except datamod.DataError as e:
        raise EvalError(str(e)) from None
    n = loader.num_batches if max_batches is None else min(max_batches, loader.num_batches)
    total = None
    for _ in range(n):
        x, y = loader.next_batch()
        loss = model.forward(x, y, check_tokens=False)   # the loader checked the ids
        total = loss.astype(np.float64) if total is None else total + loss
    loss = float(total) / n
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "tokens": n * Bv * T, "batches": n, "B": Bv, "T": T,
            "files": [str(f) for f in loader.files]}


# ------------------------------------------------------------- hellaswag ----

@dataclass
class Example:
    """One multiple-choice example: shared context tokens, candidate endings, the right one."""
    index: int
    label: int
    ctx_tokens: list
    ending_tokens: list       # list of token lists


def render_example(ex: dict, index: int = 0) -> Example:
    """A HellaSwag jsonl record -> Example, tokenized as llm.c's hellaswag.py (" " + ending)."""
    from . import tokenizer
    try:
        ctx, endings, label = ex["ctx"], ex["endings"], ex["label"]
    except KeyError as e:
        raise EvalError(f"example {index}: missing field {e.args[0]!r} (need ctx, endings, label)") from None
    try:
        label = int(label)
    except (TypeError, ValueError):
        raise EvalError(f"example {index}: label {label!r} is not an integer") from None
    if not isinstance(endings, list) or not endings or not all(isinstance(e, str) for e in endings):
        raise EvalError(f"example {index}: endings must be a non-empty list of strings")
    return Example(index, label, tokenizer.encode(str(ctx)), [tokenizer.encode(" " + e) for e in endings])


def read_hellaswag_jsonl(path) -> list[Example]:
    path = Path(path)
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EvalError(f"{path}: HellaSwag file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"{path}: cannot read as UTF-8 text ({e})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{i + 1}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict):
            raise EvalError(f"{path}:{i + 1}: expected a JSON object")
        try:
            out.append(render_example(rec, len(out)))
        except EvalError as e:
            raise EvalError(f"{path}:{i + 1}: {e}") from None
    return out


def write_hellaswag_bin(path, examples) -> int:
    """Write examples in llm.c's eval file format (data_common.write_evalfile); returns their count.

    examples: Example objects, dicts with "label", "ctx_tokens", "ending_tokens" (llm.c's
    `datas`), or HellaSwag jsonl records (tokenized here).
    """
    from .checkpoint import atomic_write
    exs = []
    for i, e in enumerate(examples):
        if isinstance(e, Example):
            exs.append(e)
        elif "ctx_tokens" in e:
            exs.append(Example(i, int(e["label"]), list(e["ctx_tokens"]), [list(t) for t in e["ending_tokens"]]))
        else:
            exs.append(render_example(e, i))
    if len(exs) >= 2**16:
        raise ValueError(f"examples: {len(exs)} is more than the format's uint16 index holds")
    stream, longest = [], 0
    for idx, e in enumerate(exs):
        s = [START_EXAMPLE, 0, idx, e.label, len(e.ending_tokens), len(e.ctx_tokens), *e.ctx_tokens]
        for toks in e.ending_tokens:
            s += [len(toks), *toks]
        if any(not 0 <= t < START_EXAMPLE for t in s[2:]):
            raise ValueError(f"example {idx}: a field or token is outside [0, 65535)")
        nbytes = 2 * len(s)
        if nbytes >= 2**16:
            raise ValueError(f"example {idx}: {nbytes} bytes is more than the format's uint16 size holds")
        s[1] = nbytes
        longest = max(longest, nbytes)
        stream += s
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (EVAL_MAGIC, EVAL_VERSION, len(exs), longest)
    with atomic_write(path) as f:
        f.write(header.tobytes())
        f.write(np.asarray(stream, dtype="<u2").tobytes())
    return len(exs)


def _read_llmc_file(path: Path, name: str, kind: str, magic: int, expected: str):
    """(bytes, int32 header) of an llm.c file with a 256-int header; EvalError for a missing,
    unreadable, truncated or wrong-magic file (the caller checks the version and the body)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise EvalError(f"{path}: {name} not found") from None
    except OSError as e:
        raise EvalError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) < HEADER_BYTES:
        raise EvalError(f"{path}: truncated {kind} ({len(raw)} bytes; the header alone is {HEADER_BYTES})")
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    if header[0] != magic:
        raise EvalError(f"{path}: bad magic number {header[0]} (expected {magic}): not {expected}")
    return raw, header


def read_hellaswag_bin(path) -> list[Example]:
    """Examples from llm.c's eval file (hellaswag_val.bin), validating every field."""
    path = Path(path)
    raw, header = _read_llmc_file(path, "HellaSwag file", "eval file", EVAL_MAGIC,
                                  "an llm.c eval file such as hellaswag_val.bin")
    if header[1] != EVAL_VERSION:
        raise EvalError(f"{path}: unsupported eval file version {header[1]} (expected {EVAL_VERSION})")
    num, longest = int(header[2]), int(header[3])
    if num < 0:
        raise EvalError(f"{path}: corrupt header (num_examples {num})")
    if (len(raw) - HEADER_BYTES) % 2:
        raise EvalError(f"{path}: truncated or corrupt eval file (odd number of bytes after the header)")
    s = np.frombuffer(raw[HEADER_BYTES:], dtype="<u2")
    out, pos = [], 0

    def bad(i, what):
        return EvalError(f"{path}: example {i}: {what}: truncated or corrupt eval file")

    for i in range(num):
        if pos + 6 > s.size:
            raise bad(i, f"ends at byte {HEADER_BYTES + 2 * s.size} (header says {num} examples)")
        start, nbytes, index, label, ncomp, nctx = (int(v) for v in s[pos:pos + 6])
        if start != START_EXAMPLE:
            raise bad(i, f"expected the <START_EXAMPLE> delimiter 65535, got {start}")
        if index != i:
            raise bad(i, f"<EXAMPLE_INDEX> is {index}")
        if nbytes % 2 or nbytes < 12 or nbytes > longest:
            raise bad(i, f"<EXAMPLE_BYTES> {nbytes} (longest_example_bytes {longest})")
        end = pos + nbytes // 2
        if end > s.size:
            raise bad(i, f"needs {nbytes} bytes, the file ends first")
        q = pos + 6
        ctx = s[q:q + nctx]
        q += nctx
        endings = []
        for _ in range(ncomp):
            if q >= end:
                raise bad(i, "completions run past <EXAMPLE_BYTES>")
            n = int(s[q])
            endings.append(s[q + 1:q + 1 + n].astype(int).tolist())
            q += 1 + n
        if q != end:
            raise bad(i, f"fields take {2 * (q - pos)} bytes, <EXAMPLE_BYTES> says {nbytes}")
        if not 0 <= label < max(ncomp, 1):
            raise bad(i, f"label {label} with {ncomp} completions")
        out.append(Example(i, label, ctx.astype(int).tolist(), endings))
        pos = end
    if pos != s.size:
        raise EvalError(f"{path}: {2 * (s.size - pos)} bytes after the last of {num} examples: corrupt eval file")
    return out


def read_hellaswag(path) -> list[Example]:
    """Examples from a HellaSwag .jsonl or llm.c .bin file (chosen by content: '{' starts jsonl)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(1)
    except FileNotFoundError:
        raise EvalError(f"{path}: HellaSwag file not found") from None
    except IsADirectoryError:
        raise EvalError(f"{path}: is a directory, expected a HellaSwag .jsonl or .bin file") from None
    except OSError as e:
        raise EvalError(f"{path}: cannot read ({e.strerror})") from None
    if path.suffix in (".jsonl", ".json") or head == b"{":
        return read_hellaswag_jsonl(path)
    return read_hellaswag_bin(path)


def _rows(ex: Example):
    """(inputs, targets) per candidate: the row context+ending without its last token; targets
    are the next tokens where they are ending tokens, -1 elsewhere (llm.c's mask)."""
    rows = []
    for end in ex.ending_tokens:
        seq = list(ex.ctx_tokens) + list(end)
        tgt = [-1] * (len(ex.ctx_tokens) - 1) + list(end)
        rows.append((seq[:-1], tgt))
    return rows


def evaluate_hellaswag(model, examples, rows_per_batch: int = 32, max_examples: int | None = None) -> dict:
    """Score each candidate ending by its token losses; {acc, acc_norm, examples, skipped, T,
    per_example: [{index, label, sum_losses, mean_losses, pred, pred_norm}]}.

    examples: a path (jsonl or llm.c .bin) or a list of Example. All rows share one T (the longest
    row, context+ending-1 tokens), padded with EOT, targets -1 where not scored; examples whose
    rows exceed the model's max_seq_len are skipped (counted in `skipped`).
    """
    from .tokenizer import EOT
    cfg, xp = model.config, model.xp
    if not isinstance(examples, (list, tuple)):
        examples = read_hellaswag(examples)
    if max_examples is not None:
        examples = examples[:max_examples]
    kept, skipped = [], 0
    for ex in examples:
        if not ex.ctx_tokens:
            raise EvalError(f"example {ex.index}: empty context (the first ending token needs one before it)")
        if not ex.ending_tokens or any(len(e) == 0 for e in ex.ending_tokens):
            raise EvalError(f"example {ex.index}: an ending has no tokens")
        if not 0 <= ex.label < len(ex.ending_tokens):
            raise EvalError(f"example {ex.index}: label {ex.label} with {len(ex.ending_tokens)} endings")
        toks = list(ex.ctx_tokens) + [t for e in ex.ending_tokens for t in e]
        if max(toks) >= cfg.vocab_size:
            raise EvalError(f"example {ex.index}: token id {max(toks)} >= the model's vocab_size {cfg.vocab_size}")
        if len(ex.ctx_tokens) + max(len(e) for e in ex.ending_tokens) - 1 > cfg.max_seq_len:
            skipped += 1
        else:
            kept.append(ex)
    if not kept:
        raise EvalError(f"no HellaSwag example to score ({skipped} longer than the model's max_seq_len "
                        f"{cfg.max_seq_len})" if skipped else "no HellaSwag examples")
    rows, owner = [], []
    for k, ex in enumerate(kept):
        for r in _rows(ex):
            rows.append(r)
            owner.append(k)
    T = max(len(x) for x, _ in rows)
    R = max(1, min(int(rows_per_batch), len(rows)))
    sums = np.zeros(len(rows))
    counts = np.zeros(len(rows))
    X = np.full((R, T), EOT, dtype=np.int32)
    Y = np.full((R, T), -1, dtype=np.int32)
    for r0 in range(0, len(rows), R):
        chunk = rows[r0:r0 + R]
        X.fill(EOT)
        Y.fill(-1)
        for j, (x, y) in enumerate(chunk):
            X[j, :len(x)] = x
            Y[j, :len(y)] = y
        n = len(chunk)
        model.forward(xp.asarray(X[:n]), xp.asarray(Y[:n]), check_tokens=False)   # ids checked above
        losses = _host(model.acts.losses).astype(np.float64)[:n]
        mask = Y[:n] != -1
        sums[r0:r0 + n] = (losses * mask).sum(axis=1)
        counts[r0:r0 + n] = mask.sum(axis=1)
    per, correct, correct_norm, i = [], 0, 0, 0
    for k, ex in enumerate(kept):
        c = len(ex.ending_tokens)
        s, m = sums[i:i + c], sums[i:i + c] / counts[i:i + c]
        i += c
        pred, pred_norm = int(np.argmin(s)), int(np.argmin(m))
        correct += pred == ex.label
        correct_norm += pred_norm == ex.label
        per.append({"index": ex.index, "label": ex.label, "sum_losses": s.tolist(), "mean_losses": m.tolist(),
                    "pred": pred, "pred_norm": pred_norm})
    return {"acc": correct / len(kept), "acc_norm": correct_norm / len(kept), "examples": len(kept),
            "skipped": skipped, "T": T, "per_example": per}


# ------------------------------------------------------------ debug state ----

@dataclass
class DebugState:
    B: int
    T: int
    x: np.ndarray            # (B, T) int32
    y: np.ndarray            # (B, T) int32
    logits: np.ndarray       # (B, T, V) float32
    loss: float
    grads: np.ndarray        # flat float32, every parameter in llm.c's order (wte padded to Vp)


def write_debug_state(path, x, y, logits, loss, grads_flat) -> None:
    """Write an llm.c debug state (version 2) as train_gpt2.py's write_state does.

    logits (B, T, V) (unpadded vocabulary); grads_flat: every parameter's gradient in llm.c's
    order with wte padded to Vp rows (gpucore's flat gradient buffer is exactly that).
    """
    from .checkpoint import atomic_write
    x, y = np.asarray(_host(x), dtype="<i4"), np.asarray(_host(y), dtype="<i4")
    if x.ndim != 2 or y.shape != x.shape:
        raise ValueError(f"x, y: expected two (B, T) arrays, got {x.shape} and {y.shape}")
    B, T = x.shape
    logits = np.asarray(_host(logits), dtype="<f4")
    if logits.ndim != 3 or logits.shape[:2] != (B, T):
        raise ValueError(f"logits: expected (B={B}, T={T}, V), got {logits.shape}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (STATE_MAGIC, STATE_VERSION, B, T)
    with atomic_write(path) as f:
        for a in (header, x, y, logits, np.asarray(_host(loss), dtype="<f4").reshape(1),
                  np.asarray(_host(grads_flat), dtype="<f4").reshape(-1)):
            f.write(np.ascontiguousarray(a).tobytes())


def read_debug_state(path, vocab_size: int = LLMC_VOCAB) -> DebugState:
    """llm.c's gpt2_124M_debug_state.bin (see the module docstring); the gradients are
    whatever follows the loss (their split is checked against a model in check_debug_state)."""
    path = Path(path)
    raw, h = _read_llmc_file(path, "debug state file", "debug state", STATE_MAGIC, "an llm.c debug state")
    if h[1] != STATE_VERSION:
        raise EvalError(f"{path}: debug state version {h[1]} (expected {STATE_VERSION}, padded vocab); "
                        "re-run llm.c's train_gpt2.py to write a new one")
    B, T = int(h[2]), int(h[3])
    if B < 1 or T < 1:
        raise EvalError(f"{path}: corrupt header (B={B}, T={T})")
    n_lead = 2 * B * T + B * T * vocab_size + 1
    need = HEADER_BYTES + 4 * n_lead
    if len(raw) <= need or (len(raw) - need) % 4:
        raise EvalError(f"{path}: {len(raw)} bytes is too short or not whole for B={B}, T={T}, V={vocab_size} "
                        f"({need} bytes before the gradients): truncated or corrupt")
    body = np.frombuffer(raw, dtype="<i4", offset=HEADER_BYTES)
    x = body[:B * T].reshape(B, T).astype(np.int32)
    y = body[B * T:2 * B * T].reshape(B, T).astype(np.int32)
    f = np.frombuffer(raw, dtype="<f4", offset=HEADER_BYTES + 8 * B * T)
    logits = f[:B * T * vocab_size].reshape(B, T, vocab_size)
    loss = float(f[B * T * vocab_size])
    grads = f[B * T * vocab_size + 1:]
    return DebugState(B, T, x, y, logits, loss, grads)


def _split_grads(model, flat: np.ndarray) -> dict:
    """{name: array} of the file's gradients in the model's layout; wte may have any number of
    padded rows >= V (llm.c pads to a multiple of 128)."""
    from .model import parameter_specs
    cfg = model.config
    specs = parameter_specs(cfg)
    rest = sum(int(np.prod(s)) for n, s, _ in specs if n != "wte")
    wte_elems = flat.size - rest
    C = cfg.channels
    if wte_elems < cfg.vocab_size * C or wte_elems % C:
        raise EvalError(f"debug state: {flat.size} gradient values do not fit this model "
                        f"({cfg.describe()}: {rest} outside wte + at least {cfg.vocab_size}x{C} for wte)")
    out, o = {}, 0
    for name, shape, _ in specs:
        if name == "wte":
            shape = (wte_elems // C, C)
        n = int(np.prod(shape))
        out[name] = flat[o:o + n].reshape(shape)
        o += n
    return out


def check_debug_state(model, state: DebugState, tolerance: str = "c") -> dict:
    """Forward (fp32) + backward on the state's batch; compare with its logits, loss and grads.

    Returns {ok, B, T, tolerance, logits: {maxdiff, tol, ok}, loss: {expected, got, diff, tol, ok},
    grads: [{name, maxdiff, tol, ok, elements}], failed: [names]}.
    """
    from . import dtypes
    tol = TOLERANCES[tolerance]
    cfg, xp = model.config, model.xp
    if model.dtype != dtypes.float32:
        raise EvalError("check-debug-state: the model must be float32")
    V = state.logits.shape[2]
    if V != cfg.vocab_size:
        raise EvalError(f"debug state: logits have V={V}, the model's vocab_size is {cfg.vocab_size}")
    if state.T > cfg.max_seq_len:
        raise EvalError(f"debug state: T={state.T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    lo, hi = int(min(state.x.min(), state.y.min())), int(max(state.x.max(), state.y.max()))
    if lo < 0 or hi >= V:
        raise EvalError(f"debug state: token ids from {lo} to {hi}, outside [0, {V}): corrupt file")
    expected = _split_grads(model, state.grads)
    x, y = xp.asarray(state.x), xp.asarray(state.y)
    B, T = state.B, state.T
    _, logits = model.forward(x, return_logits=True)
    logits = _host(logits)[:, :, :V].astype(np.float32)
    ldiff = float(np.abs(logits - state.logits).max())
    model.zero_grad()
    loss = float(model.forward(x, y, for_backward=True, grad_scale=1.0 / (B * T)))
    model.backward()
    got = model.grads
    report = {"B": B, "T": T, "tolerance": tolerance,
              "logits": {"maxdiff": ldiff, "tol": tol["logits"], "ok": ldiff < tol["logits"]},
              "loss": {"expected": state.loss, "got": loss, "diff": abs(loss - state.loss), "tol": tol["loss"],
                       "ok": abs(loss - state.loss) < tol["loss"]},
              "grads": []}
    for name, ref in expected.items():
        g = _host(got[name]).astype(np.float32)
        if name == "wte":   # compare the V real rows only (test_gpt2.c: V*C)
            g, ref = g[:V], ref[:V]
        if g.shape != ref.shape:
            raise EvalError(f"debug state: {name} gradient has shape {ref.shape}, the model's is {g.shape}")
        diff = np.abs(g - ref)
        bound = tol["grad_abs"] + tol["grad_rel"] * np.abs(ref)
        ok = bool(np.all(diff <= bound))   # NaN fails
        report["grads"].append({"name": name, "maxdiff": float(diff.max()), "tol": tol["grad_abs"],
                                "rel_tol": tol["grad_rel"], "ok": ok, "elements": int(ref.size)})
    report["failed"] = ([k for k in ("logits", "loss") if not report[k]["ok"]]
                        + [g["name"] for g in report["grads"] if not g["ok"]])
    report["ok"] = not report["failed"]
    return report


def format_debug_report(r: dict) -> list[str]:
    lines = [f"debug state B={r['B']} T={r['T']}, tolerances of llm.c's "
             f"{'test_gpt2.c' if r['tolerance'] == 'c' else 'test_gpt2.cu (fp32)'}"]
    lines.append(f"{'tensor':<10s} {'max |diff|':>12s} {'tolerance':>12s}  result")
    lg = r["logits"]
    lines.append(f"{'logits':<10s} {lg['maxdiff']:12.3e} {lg['tol']:12.1e}  {'OK' if lg['ok'] else 'MISMATCH'}")
    ls = r["loss"]
    lines.append(f"{'loss':<10s} {ls['diff']:12.3e} {ls['tol']:12.1e}  {'OK' if ls['ok'] else 'MISMATCH'}"
                 f"  ({ls['got']:.6f} vs expected {ls['expected']:.6f})")
    for g in r["grads"]:
        t = f"{g['tol']:.1e}" + (f"+{g['rel_tol']:g}|ref|" if g["rel_tol"] else "")
        lines.append(f"{'d' + g['name']:<10s} {g['maxdiff']:12.3e} {t:>12s}  {'OK' if g['ok'] else 'MISMATCH'}")
    lines.append("overall: OK" if r["ok"] else f"overall: MISMATCH in {', '.join(r['failed'])}")
    return lines


# --------------------------------------------------------------- commands ----

def _load(path, device: str = "auto", dtype: str = "auto"):
    """(model, description) from a checkpoint/weights file: gpucore.weights.load_gpt2 when it
    exists (HF / llm.c / gpucore files), else gpucore.checkpoint.load_model (gpucore's own)."""
    from .startup import TrainError, resolve_backend
    try:
        _, xp, dt = resolve_backend(device, dtype)
    except TrainError as e:
        raise click.ClickException(str(e)) from None
    try:
        from .weights import load_gpt2
    except ImportError:
        load_gpt2 = None
    try:
        if load_gpt2 is not None:
            model, desc = load_gpt2(path, xp, dt)
        else:
            from .checkpoint import load_model
            model, meta = load_model(path, xp=xp, dtype=dt)
            desc = f"{path}: gpucore checkpoint, step {meta.get('step', '?')}, {model.config.describe()}"
    except click.ClickException:
        raise
    except FileNotFoundError as e:
        raise click.ClickException(f"{path}: not found ({e.strerror or e})") from None
    except Exception as e:   # the loaders' own error classes (one line each); anything else is a bug
        if not (isinstance(e, (ValueError, OSError, KeyError)) or type(e).__module__.startswith("gpucore")):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        raise click.ClickException(msg or f"{path}: cannot load ({type(e).__name__})") from None
    return model, desc


def _write_json(path, obj):
    from .checkpoint import atomic_write
    try:
        with atomic_write(path) as f:
            f.write((json.dumps(obj, indent=2) + "\n").encode())
    except OSError as e:
        raise click.ClickException(f"--json {path}: cannot write ({e.strerror or e})") from None


@click.command("eval")
@click.option("--init-from", "init_from", required=True, metavar="PATH",
              help="Model: a gpucore checkpoint (or, with gpucore.weights, HF / llm.c weights).")
@click.option("--data", default=None, metavar="PATH",
              help="llm.c token shards: a .bin file, a directory (its *_val*.bin), or a glob.")
@click.option("-B", "--batch-size", "B", default=8, show_default=True, type=int, help="Rows per batch.")
@click.option("-T", "--seq-len", "T", default=None, type=int,
              help="Sequence length (default: min(1024, the model's max_seq_len)).")
@click.option("--max-batches", default=None, type=int, help="Evaluate at most N batches (default: all).")
@click.option("--hellaswag", default=None, metavar="FILE",
              help="HellaSwag .jsonl or llm.c's hellaswag_val.bin (from llm.c's dev/data/hellaswag.py).")
@click.option("--max-examples", default=None, type=int, help="HellaSwag: score the first N examples only.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True)
@click.option("--json", "json_out", default=None, metavar="OUT", help="Also write the metrics as JSON.")
def eval_command(init_from, data, B, T, max_batches, hellaswag, max_examples, device, dtype, json_out):
    """Loss / perplexity over token shards and HellaSwag accuracy of a model."""
    if data is None and hellaswag is None:
        raise click.UsageError("give --data PATH and/or --hellaswag FILE")
    model, desc = _load(init_from, device, dtype)
    click.echo(f"model {desc}")
    out = {"model": desc, "init_from": str(init_from)}
    try:
        if data is not None:
            T_ = T if T is not None else min(1024, model.config.max_seq_len)
            r = evaluate_loss(model, data, B, T_, max_batches)
            out.update({k: r[k] for k in ("loss", "perplexity", "tokens", "batches", "B", "T")})
            out["data"] = str(data)
            click.echo(f"loss {r['loss']:.6f}")
            click.echo(f"perplexity {r['perplexity']:.4f}")
            click.echo(f"tokens {r['tokens']} ({r['batches']} batches of B={r['B']} T={r['T']})")
        if hellaswag is not None:
            h = evaluate_hellaswag(model, hellaswag, rows_per_batch=4 * max(1, B), max_examples=max_examples)
            out["hellaswag"] = h
            click.echo(f"hellaswag_acc {h['acc']:.4f}")
            click.echo(f"hellaswag_acc_norm {h['acc_norm']:.4f}")
            skip = f" ({h['skipped']} skipped: longer than max_seq_len)" if h["skipped"] else ""
            click.echo(f"hellaswag_examples {h['examples']}{skip}")
    except EvalError as e:
        raise click.ClickException(str(e)) from None
    if json_out is not None:
        _write_json(json_out, out)


@click.command("check-debug-state")
@click.option("--init-from", "init_from", required=True, metavar="PATH",
              help="The weights the state was made with (llm.c: gpt2_124M.bin).")
@click.option("--state", "state_path", default="gpt2_124M_debug_state.bin", show_default=True, metavar="PATH",
              help="llm.c's debug state, written by llm.c's train_gpt2.py.")
@click.option("--tolerance", type=click.Choice(sorted(TOLERANCES)), default="c", show_default=True,
              help="c: test_gpt2.c's (logits/loss 1e-2, grads 2e-2); cu: test_gpt2.cu's fp32 ones.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--json", "json_out", default=None, metavar="OUT", help="Also write the report as JSON.")
def check_debug_state_command(init_from, state_path, tolerance, device, json_out):
    """Compare one fp32 forward/backward with llm.c's gpt2_124M_debug_state.bin; exit 1 on a mismatch."""
    model, desc = _load(init_from, device, "float32")
    try:
        state = read_debug_state(state_path, model.config.vocab_size)
        r = check_debug_state(model, state, tolerance)
    except EvalError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"model {desc}")
    for line in format_debug_report(r):
        click.echo(line)
    if json_out is not None:
        _write_json(json_out, {"model": desc, **r})
    if not r["ok"]:
        raise click.ClickException(f"debug state mismatch: {', '.join(r['failed'])}")
