"""Probe: which GEMM algorithms did independent races pick? Reads two or more tune caches
(cublaslt_algos.json files, e.g. one per HOME or per `GPUCORE_SETTINGS=lt_tune_cache=PATH` of
tools/ab_train.py variants) and prints, per GEMM key, each cache's choice -- in words (tile, stages,
split-K, swizzle, cluster) where cuBLASLt loads, else the first bytes of its hex -- marking the keys
whose choices differ. With whole-step times of the same variants beside it, this says whether the
spread between runs with separate caches is the race's picks.

Run:  PYTHONPATH=. python3 tools/probes/tune_cache_diff.py A.json B.json [C.json ...]
"""
import ast
import ctypes
import json
import sys
from pathlib import Path

from gpucore import cublas, lt_search
from gpucore.tune import describe_key


def decode(lib, value: str) -> str:
    if value == cublas.GEMMEX:
        return "gemmEx"
    if lib is None:
        return value[:16] + "..."
    raw = bytes.fromhex(value)
    buf = (ctypes.c_ubyte * max(len(raw), 256))()
    ctypes.memmove(buf, raw, len(raw))
    return lt_search.describe(lib, ctypes.addressof(buf))


def key_words(tkey: str) -> str:
    try:
        return describe_key((0,) + ast.literal_eval(tkey.rsplit("|", 1)[1]))
    except (ValueError, SyntaxError, IndexError, KeyError, TypeError):
        return tkey


def main(paths):
    if len(paths) < 2:
        sys.exit(__doc__)
    caches = [json.loads(Path(p).read_text()) for p in paths]
    lt = cublas.lt_binding()
    lib = lt.lib if lt is not None else None
    keys = sorted(set().union(*caches), key=key_words)
    differ = 0
    for k in keys:
        choices = [decode(lib, c[k]) if k in c else "-" for c in caches]
        same = len(set(choices)) == 1
        differ += not same
        print(f"{'  ' if same else '* '}{key_words(k)}")
        for p, ch in zip(paths, choices):
            print(f"      {Path(p).name:<24} {ch}")
    print(f"{differ} of {len(keys)} GEMM keys differ between the {len(paths)} caches")


if __name__ == "__main__":
    main(sys.argv[1:])
