"""What the tests and the benchmarks share, so that neither imports the other.

- ``kz_stream.testing.corpus``: reference problems and candidate kernels for the verifier:
  honest Triton and CUDA ones, cheats (each with the check that must catch it), degenerate
  problems, full-size (KernelBench-sized) ones, and the hostile corpus with the host it is
  aimed at (``corpus.hostile.HostileHost``).
- ``kz_stream.testing.tiny``: a tiny causal LM built from a config (no download), its
  tokenizer, a checkable task and a sampler that records logprobs.
- ``kz_stream.testing.data_parallel``: the learner's step on N processes against one.

Submodules are imported on use: the corpora need nothing, ``tiny`` and ``data_parallel``
need the ``llm`` extra (transformers).
"""

from __future__ import annotations

__all__ = ["corpus", "data_parallel", "tiny"]
