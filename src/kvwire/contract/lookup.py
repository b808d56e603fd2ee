"""The optional protocol ``lookup`` (L1, contract 1.1): ask the other end which content names it
holds now, without moving or pinning anything.

A backend that declares it (``LOOKUP in capabilities().protocols``) also implements
:class:`Lookup`. The answer is advice for a scheduler deciding how much of a prompt to load, not
a promise: a fetch after a true answer may still miss, and that miss is a miss (A5), never a
fault."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from kvwire.contract.errors import InvalidSubmission
from kvwire.contract.hint import Hint
from kvwire.contract.view import MAX_NAME_BYTES

__all__ = ["LOOKUP", "Lookup", "lookup_arguments"]

#: The optional protocol of a backend that answers which names the other end holds (L1).
LOOKUP = "lookup"


class Lookup(abc.ABC):
    """What a backend that declares ``lookup`` offers besides :class:`~kvwire.contract.Backend`."""

    @abc.abstractmethod
    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        """Which of ``names`` the other end named by ``hint`` holds now.

        ``names`` has shape ``(n, width)``, uint8, ``1 <= width <= 64``: the content names a
        view's rows would carry. The answer is a new, read-only, plain bool array of ``n``: true
        where the other end holds that name in *every* group of ``groups`` (a store keys rows by
        (group, name), N1). It takes no pins and changes nothing; a later fetch may still miss.

        Blocks at most ``timeout_s`` (default: the hint's ``timeout_s``, else the backend's
        deadline option). Raises ``InvalidSubmission`` for an unusable hint or bad arguments,
        ``SubmissionRejected`` after ``shutdown()``, and :class:`~kvwire.contract.LookupFailed`
        when the other end faulted or the deadline passed."""


def lookup_arguments(groups: Sequence[int], names: object) -> tuple[tuple[int, ...], np.ndarray]:
    """``groups`` as distinct non-negative ints in the order given and ``names`` as a read-only
    ``(n, width)`` uint8 array, or ``InvalidSubmission`` saying what is wrong. For backends that
    implement :class:`Lookup`."""
    if isinstance(groups, np.ndarray) and groups.ndim == 1:
        groups = groups.tolist()
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise InvalidSubmission(f"lookup groups must be a sequence of group ids, got {type(groups).__name__}")
    ids: list[int] = []
    for group in groups:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or int(group) < 0:
            raise InvalidSubmission(f"lookup group ids are ints >= 0, got {group!r}")
        if int(group) not in ids:
            ids.append(int(group))
    if not ids:
        raise InvalidSubmission("lookup needs at least one group: a name is held in every group listed")
    if not isinstance(names, np.ndarray) or names.dtype != np.uint8 or names.ndim != 2:
        what = (f"an array of dtype {names.dtype} and shape {names.shape}" if isinstance(names, np.ndarray)
                else f"a {type(names).__name__}")
        raise InvalidSubmission(f"lookup names must be a 2-D uint8 numpy array (n, width), got {what}")
    width = names.shape[1]
    if not 1 <= width <= MAX_NAME_BYTES:
        raise InvalidSubmission(f"lookup name width must be 1..{MAX_NAME_BYTES} bytes, got {width}")
    frozen = np.array(names, dtype=np.uint8, copy=True)
    frozen.setflags(write=False)
    return tuple(ids), frozen
