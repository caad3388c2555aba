"""A module's fingerprint for decontamination: the APIs it uses and the inputs it takes.

Two modules with one fingerprint pose the same problem in other words: the same kernel
work (canonical APIs, layout and arithmetic left out as validation and the catalog leave
them out) on inputs of the same shapes and dtypes, whatever the names, parameters or code
around them. Both parts are sorted, so reordering ``forward``'s arguments or the calls in
it does not make a new problem. The same APIs at other shapes is another fingerprint: the
Proposer is meant to recombine APIs, and a problem is its sizes as much as its operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kz_stream.modules._apis import is_neutral

__all__ = ["InputSpec", "ModuleFingerprint", "input_specs"]


class InputSpec(NamedTuple):
    """One value of ``get_inputs()``: a tensor's dtype and shape, or the type name of a
    value that is not a tensor (its shape then empty)."""

    dtype: str
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class ModuleFingerprint:
    """The sorted API set (neutral ops left out) and the sorted input specs of a module."""

    apis: tuple[str, ...]
    inputs: tuple[InputSpec, ...]

    @classmethod
    def of(cls, apis: Iterable[str], inputs: Iterable[InputSpec]) -> ModuleFingerprint:
        return cls(
            apis=tuple(sorted({a for a in apis if not is_neutral(a)})),
            inputs=tuple(sorted(InputSpec(i.dtype, tuple(i.shape)) for i in inputs)),
        )

    def __str__(self) -> str:
        return f"APIs {{{', '.join(self.apis)}}} on inputs {', '.join(map(str, self.inputs))}"


def input_specs(values: Sequence[Any]) -> list[InputSpec]:
    """The specs of ``get_inputs()``'s values (sandbox side: torch is imported there)."""
    import torch

    return [
        InputSpec(str(v.dtype).removeprefix("torch."), tuple(int(d) for d in v.shape))
        if isinstance(v, torch.Tensor)
        else InputSpec(type(v).__name__)
        for v in values
    ]
