"""Kernel ladders: the versions of an op that teach how its fast kernel came to be.

llm.c keeps one kernel per op in `llmc/` and its version ladders in `dev/cuda/`;
gpucore does the same. The training path (gpucore/ops, gpucore/model.py) never
imports this package: each module here builds on the production op of its
family and adds the rungs that lost or that exist to be read and measured
(`gpucore bench <family> --version ...`, tests/ladder/).

    gemm        our own GEMM, v1 (naive SIMT) .. v6 (warp-specialized Hopper wgmma)
    attention   the v3 forward without its pipeline (the step before the default), every tile
                configuration of the production kernels (the sweep), and the fused-D backward
"""
