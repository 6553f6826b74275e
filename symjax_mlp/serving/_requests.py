"""A batcher's request check: each input's rank, row shape, dtype and rows, and why not.

A NumPy request whose ``(shape, dtype)`` passed once is looked up in a dict instead of being
checked again: at most ``max_batch`` keys per input signature, since only the rows may differ.
A refused request is counted (``rejected_by["signature"]``) and raises a
:class:`~symjax_mlp.SignatureError` that says which input, what it has, what a request takes
and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from symjax_mlp._errors import SignatureError
from symjax_mlp._specs import TensorSpec
from symjax_mlp.serving._lane import Lane


class RequestCheck:
    """Checks requests against a batcher's specs: :meth:`check` gives their arrays and rows."""

    def __init__(self, name: str, specs: Sequence[TensorSpec], lane: Lane, max_batch: int) -> None:
        self.name, self.specs, self.lane, self.max_batch = name, specs, lane, max_batch
        self.ranks = [len(shape) + 1 for shape in lane.row_shapes]
        # The NumPy shapes (a tuple of them for several inputs) that passed the check, with
        # their rows; a request's dtypes must be these very objects to be looked up.
        self.accepted: dict[Any, int] = {}
        self.dtypes = tuple(lane.dtypes)

    def check(self, inputs: tuple[Any, ...]) -> tuple[Sequence[Any], int]:
        """The request's arrays and rows; NumPy inputs of a shape seen before are looked up."""
        if len(inputs) == 1:
            x = inputs[0]
            if type(x) is np.ndarray and x.dtype is self.dtypes[0]:
                rows = self.accepted.get(x.shape)
                if rows is not None:
                    return inputs, rows
        elif all(type(x) is np.ndarray for x in inputs) and [x.dtype for x in inputs] == list(
            self.dtypes
        ):
            rows = self.accepted.get(tuple([x.shape for x in inputs]))
            if rows is not None:
                return inputs, rows
        return self._check_slow(inputs)

    def _check_slow(self, inputs: tuple[Any, ...]) -> tuple[Sequence[Any], int]:
        lane = self.lane
        if len(inputs) != len(lane.dtypes):
            self._reject()
            want = ", ".join(map(str, self.specs))
            raise SignatureError(
                f"{self.name}: a request takes {len(lane.dtypes)} input(s) ({want}); got "
                f"{len(inputs)}. Call it as b({', '.join(s.path for s in self.specs)})."
            )
        arrays, rows, numpy = [], None, True
        for x, shape, dtype, rank in zip(
            inputs, lane.row_shapes, lane.dtypes, self.ranks, strict=True
        ):
            numpy = numpy and type(x) is np.ndarray
            a = x if type(x) is np.ndarray else np.asarray(x)  # read on the host anyway
            if (
                a.ndim != rank
                or a.shape[1:] != shape
                or a.dtype != dtype
                or not 0 < a.shape[0] <= self.max_batch
                or (rows is not None and a.shape[0] != rows)
            ):
                self._reject()
                raise SignatureError(self._explain(len(arrays), a, rows))
            rows = a.shape[0]
            arrays.append(a)
        if numpy:  # at most max_batch keys: only the rows may differ
            shapes = tuple(a.shape for a in arrays)
            self.accepted[shapes[0] if len(shapes) == 1 else shapes] = rows
        return arrays, rows  # type: ignore[return-value]

    def _explain(self, i: int, a: np.ndarray, rows: int | None) -> str:
        spec, lane = self.specs[i], self.lane
        want = f"{spec.type} with 1 <= b <= {self.max_batch} rows"
        head = f"{self.name}: input {spec.path} has shape {a.shape} and dtype {a.dtype}, but a "
        head += f"request takes {want}"
        shape = lane.row_shapes[i]
        if a.ndim != len(shape) + 1:
            hint = (
                "Add the batch dimension: x[None] (one row)."
                if a.shape == shape
                else f"Pass an array of rank {len(shape) + 1}."
            )
            return f"{head}: rank {a.ndim}, not {len(shape) + 1}. {hint}"
        if a.shape[1:] != shape:
            return f"{head}: each row is {a.shape[1:]}, not {shape}. Pass rows of shape {shape}."
        if a.dtype != lane.dtypes[i]:
            return f"{head}. Cast it: x.astype(np.{lane.dtypes[i]})."
        if a.shape[0] < 1:
            return f"{head}: it has no rows. Pass at least one row."
        if a.shape[0] > self.max_batch:
            return (
                f"{head}: it has {a.shape[0]} rows. Split it into requests of at most "
                f"{self.max_batch} rows, or make a Batcher with max_batch >= {a.shape[0]}."
            )
        return (
            f"{head}: it has {a.shape[0]} rows but {self.specs[0].path} has {rows}; the inputs "
            "of one request must have the same number of rows."
        )

    def _reject(self) -> None:
        with self.lane.lock:
            self.lane.n.rejected["signature"] += 1
