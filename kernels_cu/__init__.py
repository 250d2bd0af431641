"""CUDA sources of gpucore, shipped as package data (gpucore.kernels_cu).

Nothing to import here: gpucore.runtime reads the .cu/.cuh files and compiles
them with NVRTC at run time. This file only makes the folder installable.
"""
