"""Reference modules that admission must reject, and ones it must admit."""

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"

ZEROS = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(-torch.abs(x))

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''

CONSTANT = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x.sum(dim=1, keepdim=True), dim=1)  # softmax over one element

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''

IDENTITY = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=-1e6, max=1e6)

def get_inputs():
    return [torch.rand(64, 128)]

def get_init_inputs():
    return []
'''

INPUT_INDEPENDENT = HEADER + '''
class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))
    def forward(self, x):
        return self.w * 2.0 + 0.0 * x.sum()

def get_inputs():
    return [torch.rand(16, 32)]

def get_init_inputs():
    return [32]
'''

WEIGHT_INDEPENDENT = HEADER + '''
class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)
    def forward(self, x):
        y = self.lin(x)
        return x * 3.0 + 0.0 * y

def get_inputs():
    return [torch.randn(16, 32)]

def get_init_inputs():
    return [32]
'''

NONDETERMINISTIC = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return F.dropout(x, p=0.5, training=True)

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''

CRASHES = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return x @ x  # (64, 128) @ (64, 128): shape error

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''
CONSTANT_INDEX = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.argmax(x * 0.0 + torch.arange(128.0), dim=1)  # always the last column

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''

# Integer outputs that are a real answer: admitted (their constant is an index).
ROW_ARGMAX = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return torch.argmax(torch.softmax(x, dim=1), dim=1)

def get_inputs():
    return [torch.randn(64, 128)]

def get_init_inputs():
    return []
'''


NO_INTERFACE = HEADER + '''
class Model(nn.Module):
    def forward(self, x):
        return x
'''

DEGENERATE = {
    "zeros": ZEROS,
    "constant": CONSTANT,
    "identity": IDENTITY,
    "input_independent": INPUT_INDEPENDENT,
    "weight_independent": WEIGHT_INDEPENDENT,
    "nondeterministic": NONDETERMINISTIC,
    "exception": CRASHES,
    "interface": NO_INTERFACE,
}
