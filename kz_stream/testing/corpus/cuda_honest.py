"""Honest CUDA candidates (``load_inline``), written as a Coder would."""

RELU = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = """
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long stride = (long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float v = x[i];
        y[i] = v > 0.f ? v : 0.f;
    }
}

torch::Tensor relu_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    long n = xc.numel();
    int threads = 256;
    int blocks = (int)std::min<long>((n + threads - 1) / threads, 65535L * 8);
    relu_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

cpp_src = "torch::Tensor relu_cuda(torch::Tensor x);"

relu_ext = load_inline(
    name="relu_ext",
    cpp_sources=cpp_src,
    cuda_sources=cuda_src,
    functions=["relu_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return relu_ext.relu_cuda(x)
'''

GELU_SCALE = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <math.h>

__global__ void gelu_scale_add(const float* x, const float* y, float* out, float scale, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        float g = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        out[i] = g * scale + y[i];
    }
}

torch::Tensor gelu_scale_add_cuda(torch::Tensor x, torch::Tensor y, float scale) {
    auto out = torch::empty_like(x);
    int n = x.numel();
    const int block = 256;
    gelu_scale_add<<<(n + block - 1) / block, block>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), scale, n);
    return out;
}
"""

ext = load_inline(
    name="gelu_scale_add",
    cpp_sources="torch::Tensor gelu_scale_add_cuda(torch::Tensor x, torch::Tensor y, float scale);",
    cuda_sources=source,
    functions=["gelu_scale_add_cuda"],
)


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return ext.gelu_scale_add_cuda(x.contiguous(), y.contiguous(), float(self.scale))
'''

ROW_SUM = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>

__global__ void row_sum_kernel(const float* x, float* out, int rows, int cols) {
    extern __shared__ float buf[];
    int r = blockIdx.x;
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += x[(long)r * cols + c];
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = buf[0];
}

torch::Tensor row_sum(torch::Tensor x) {
    auto xc = x.contiguous();
    int rows = xc.size(0), cols = xc.size(1);
    auto out = torch::empty({rows}, xc.options());
    int threads = 256;
    row_sum_kernel<<<rows, threads, threads * sizeof(float)>>>(
        xc.data_ptr<float>(), out.data_ptr<float>(), rows, cols);
    return out;
}
"""

mod = load_inline(name="row_sum_ext", cpp_sources="torch::Tensor row_sum(torch::Tensor x);",
                  cuda_sources=src, functions=["row_sum"])


class ModelNew(nn.Module):
    def forward(self, x):
        return mod.row_sum(x)
'''

# A template kernel dispatched with AT_DISPATCH: the fast layout instantiates it by hand.
SOFTMAX_TEMPLATE = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
#include <ATen/Dispatch.h>

template <typename scalar_t>
__global__ void softmax_rows(const scalar_t* x, scalar_t* y, int cols) {
    extern __shared__ float sm[];
    int r = blockIdx.x;
    const scalar_t* xr = x + (long)r * cols;
    scalar_t* yr = y + (long)r * cols;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, (float)xr[c]);
    sm[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sm[threadIdx.x] = fmaxf(sm[threadIdx.x], sm[threadIdx.x + s]);
        __syncthreads();
    }
    m = sm[0];
    __syncthreads();
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += expf((float)xr[c] - m);
    sm[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sm[threadIdx.x] += sm[threadIdx.x + s];
        __syncthreads();
    }
    float denom = sm[0];
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        yr[c] = (scalar_t)(expf((float)xr[c] - m) / denom);
}

torch::Tensor softmax_cuda(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int cols = xc.size(-1);
    int rows = xc.numel() / cols;
    int threads = 256;
    AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "softmax_cuda", [&] {
        softmax_rows<scalar_t><<<rows, threads, threads * sizeof(float)>>>(
            xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), cols);
    });
    return y;
}
"""

ext = load_inline(name="softmax_t", cpp_sources="torch::Tensor softmax_cuda(torch::Tensor x);",
                  cuda_sources=src, functions=["softmax_cuda"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.softmax_cuda(x)
'''

CUDA_HONEST = {
    "relu": RELU,
    "gelu_scale": GELU_SCALE,
    "row_sum": ROW_SUM,
    "softmax": SOFTMAX_TEMPLATE,
}
