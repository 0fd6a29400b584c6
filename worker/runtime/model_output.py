"""What a model's run gives the task code: one array, or an instance segmenter's two.

Most cards read one output (or several joined into one array: `Engine.outputs`). An instance
segmenter (YOLOv8-seg, YOLOv5-seg) gives two that cannot be joined: its boxes' rows, each ending in
mask coefficients, and the prototype masks those coefficients weigh. `Paired` carries both through
the pipeline, indexed by image as an array is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np


@dataclass(frozen=True, eq=False)
class Paired:
    """rows: a batch's boxes' rows (N, ...) or one image's (...); protos: the prototype masks, (N, M, h, w)
    or one image's (M, h, w)."""

    rows: np.ndarray
    protos: np.ndarray

    def __post_init__(self) -> None:
        if self.protos.ndim not in (3, 4) or (self.protos.ndim == 4 and len(self.protos) != len(self.rows)):
            raise ValueError(f"Paired: rows {self.rows.shape} and prototype masks {self.protos.shape} must be one "
                             f"image's (M, h, w) or a batch's (N, M, h, w) with the rows' N")

    def __getitem__(self, i: int) -> Paired:
        """Image i's rows and prototype masks."""
        return Paired(self.rows[i], self.protos[i])

    def __len__(self) -> int:
        return len(self.rows)


ModelOutput = Union[np.ndarray, Paired]


def one_array(output: ModelOutput, card: str) -> np.ndarray:
    """The output of a task that reads one array; a Paired one is a card naming prototype masks for a
    task that has none (the card's checks refuse that before any image)."""
    if isinstance(output, Paired):
        raise TypeError(f"model '{card}': prototype masks given to a task that reads one output")
    return output
