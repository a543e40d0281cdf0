"""dtype names, defined once: the names memo writes in plans, traces and reports, the short
aliases ``memo profile`` and ``memo estimate`` also accept, and the torch dtype of each."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DTYPES_AND_ALIASES", "DTYPE_ALIASES"]

#: The names memo writes (plan and trace meta, reports) and ``memo train --dtype`` takes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
#: Short names some flags take too.
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: Every accepted name, in the order ``--help`` lists them.
DTYPES_AND_ALIASES: dict[str, torch.dtype] = {
    name: dtype for canonical, dtype in DTYPES.items()
    for name in (canonical, *(a for a, c in DTYPE_ALIASES.items() if c == canonical))}
