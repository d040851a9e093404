"""CUDA kernels (`ops.cu`) and their CuPy backend; import `backend` only where CuPy is installed."""
