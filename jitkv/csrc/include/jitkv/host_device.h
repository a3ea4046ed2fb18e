// JITKV_HOST_DEVICE: a function of a header that both the host compiler (the CPU bindings) and nvcc
// compile, run by the CPU kernels and the CUDA kernels alike.
#pragma once

#if defined(__CUDACC__)
#define JITKV_HOST_DEVICE __host__ __device__
#else
#define JITKV_HOST_DEVICE
#endif
