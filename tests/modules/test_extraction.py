"""Code-block extraction from messy replies, and the normalized module hash."""

from __future__ import annotations

from kz_stream.modules import extract_code, normalized_hash

MODULE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
"""


def test_fenced_block_among_prose() -> None:
    reply = f"Sure! Here is the module:\n\n```python\n{MODULE}```\n\nIt applies a ReLU. Enjoy!"
    assert extract_code(reply) == MODULE


def test_prefers_the_block_with_the_required_class() -> None:
    reply = (
        "```bash\npip install torch\n```\n"
        "```python\nprint('hi')\n```\n"
        f"```py\n{MODULE}```\n"
        "```python\nx = 1\n```"
    )
    assert extract_code(reply, require="class Model") == MODULE
    assert extract_code("```python\nx = 1\n```", require="class ModelNew") is None


def test_unterminated_fence_and_trailing_junk() -> None:
    reply = f"```python\n{MODULE}\nThis module is great because\n"
    out = extract_code(reply)
    assert out is not None and out.strip() == MODULE.strip()


def test_no_fence_and_think_tags() -> None:
    reply = f"<think>I should use relu. ```python\nbad(```</think>Here you go:\n{MODULE}"
    assert extract_code(reply) == MODULE


def test_nothing_to_extract() -> None:
    assert extract_code("") is None
    assert extract_code("```python\n```") is None


def test_unparseable_code_is_returned_for_the_caller_to_judge() -> None:
    out = extract_code("```python\ndef f(:\n    pass\n```")
    assert out is not None and "def f(" in out


def test_hash_ignores_comments_docstrings_formatting_and_local_names() -> None:
    variant = '''"""A module."""
import torch
import torch.nn as nn

class Model(nn.Module):
    """Docs."""
    def forward(self,   inp):  # the input
        # apply relu
        return torch.relu(inp)
'''
    assert normalized_hash(variant) == normalized_hash(MODULE)


def test_hash_sees_real_changes() -> None:
    assert normalized_hash(MODULE) != normalized_hash(MODULE.replace("relu", "sigmoid"))
    sized = MODULE + "\nbatch_size = 16\n"
    assert normalized_hash(sized) != normalized_hash(sized.replace("16", "32"))
    assert normalized_hash("def f(:") == normalized_hash("def   f(:")
