"""One module per kernels_cu/<family>.cu: the NumPy reference and the GPU launcher side by side.

The public names are re-exported from `gpucore` itself (gpucore/__init__.py).
"""
