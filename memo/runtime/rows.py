"""A tensor assembled row by row from the parts a layer's token ranges produce."""

from __future__ import annotations

import torch

from memo.errors import internal_assert

__all__ = ["Rows"]


class Rows:
    """A tensor of ``rows`` rows (dim 0) assembled from parts put at row offsets: a layer's output,
    or its q, k, v, from the ``[0:a]`` rows and the ``[a:s]`` chunks. Allocated by the first part
    (a part that is already every row is taken as it is, without a copy)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.tensor: torch.Tensor | None = None

    def put(self, start: int, part: torch.Tensor) -> None:
        if self.tensor is None:
            if start == 0 and part.shape[0] == self.rows:
                self.tensor = part
                return
            self.tensor = part.new_empty((self.rows, *part.shape[1:]))
        self.tensor[start:start + part.shape[0]] = part

    def take(self) -> torch.Tensor:
        internal_assert(self.tensor is not None, "no rows were put")
        tensor, self.tensor = self.tensor, None
        return tensor
