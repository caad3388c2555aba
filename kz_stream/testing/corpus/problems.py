"""Reference problems in KernelBench format, one per module type."""

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"

RELU = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(4096, 4096)]

def get_init_inputs():
    return []
'''

GELU_SCALE = HEADER + '''
class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
    def forward(self, x, y):
        return F.gelu(x) * self.scale + y

def get_inputs():
    return [torch.randn(2048, 4096), torch.randn(2048, 4096)]

def get_init_inputs():
    return [0.5]
'''

ROW_SUM = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.sum(x, dim=1)

def get_inputs():
    return [torch.randn(4096, 8192)]

def get_init_inputs():
    return []
'''

SOFTMAX = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)

def get_inputs():
    return [torch.randn(4096, 2048)]

def get_init_inputs():
    return []
'''

MATMUL = HEADER + '''
class Model(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)

def get_inputs():
    return [torch.randn(1024, 2048), torch.randn(2048, 1024)]

def get_init_inputs():
    return []
'''

LINEAR_RELU = HEADER + '''
class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
    def forward(self, x):
        return torch.relu(self.linear(x))

def get_inputs():
    return [torch.randn(512, 1024)]

def get_init_inputs():
    return [1024, 2048]
'''

LAYERNORM = HEADER + '''
class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = nn.LayerNorm(n)
    def forward(self, x):
        return self.ln(x)

def get_inputs():
    return [torch.randn(8192, 1024)]

def get_init_inputs():
    return [1024]
'''

CONV1D = HEADER + '''
class Model(nn.Module):
    def __init__(self, channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)
    def forward(self, x):
        return self.conv(x)

def get_inputs():
    return [torch.randn(32, 256, 4096)]

def get_init_inputs():
    return [256, 5]
'''

# KernelBench draws its inputs with torch.rand: non-negative, where a copy is a ReLU.
RELU_RAND = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.rand(2048, 4096)]

def get_init_inputs():
    return []
'''

PROBLEMS = {
    "relu": RELU,
    "relu_rand": RELU_RAND,
    "gelu_scale": GELU_SCALE,
    "row_sum": ROW_SUM,
    "softmax": SOFTMAX,
    "matmul": MATMUL,
    "linear_relu": LINEAR_RELU,
    "layernorm": LAYERNORM,
    "conv1d_depthwise": CONV1D,
}
