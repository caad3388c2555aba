"""Reference problems and candidate kernels (honest and cheating) for the verifier tests.

Each module-level string is a complete source file, in KernelBench format for problems
(``Model``, ``get_inputs``, ``get_init_inputs``) and as a Coder would write it for
candidates (``ModelNew``).
"""
