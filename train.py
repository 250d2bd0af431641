#!/usr/bin/env python3
"""Train GPT-2 with gpucore: the same command as `gpucore train` (one click object, gpucore.cli.train).

    python train.py --model d12 -B 64 -T 1024 --steps 30
    python train.py --help

This file only makes the package importable from a source checkout and runs the command.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpucore.cli import train as command  # noqa: E402

if __name__ == "__main__":
    command()
