"""Reference problems and candidate kernels (honest and cheating) for the verifier's tests
and benchmarks.

Each module-level string is a complete source file, in KernelBench format for problems
(``Model``, ``get_inputs``, ``get_init_inputs``) and as a Coder would write it for
candidates (``ModelNew``).
"""

from __future__ import annotations

__all__ = ["cheats", "cuda_honest", "degenerate", "full_size", "hostile", "problems",
           "triton_honest"]
