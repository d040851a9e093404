"""OpenCL kernels (`ops.cl`) and their backend; import `backend` only when pyopencl is installed."""
