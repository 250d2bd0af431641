#!/usr/bin/env python3
"""Train GPT-2 with gpucore: the same options and the same function as `gpucore train`.

    python train.py --model d12 -B 64 -T 1024 --steps 30
    python train.py --help

Both entry points are built from gpucore.train.train_options and call
gpucore.train.main_from_options; this file only makes the package importable
from a source checkout and runs the command.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucore.train import command  # noqa: E402

if __name__ == "__main__":
    command()
