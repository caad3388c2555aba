"""Recording which aten ops a piece of code runs, through the dispatcher, so that calls
from C++ extensions and through any Python alias are seen alike."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._python_dispatch


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """``with OpLog() as log: ...`` leaves the op names (e.g. "addmm") in ``log.ops``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
