"""What a backend declares about itself (B4): frozen data the suite tests against."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvwire.contract.memory import MemoryKind

__all__ = ["Capabilities", "OtherEnd", "CONTRACT_VERSION", "SERVE_PULLS", "OFFER_PULLS"]

#: ``(major, minor)``: the newest version this kvwire knows. A backend declares the literal version
#: it implements (docs/contract.md, Versions), never this constant, which moves with kvwire.
CONTRACT_VERSION: tuple[int, int] = (1, 3)

#: The optional protocol of a peer backend that answers request-free pulls from its reuse tree.
SERVE_PULLS = "serve-pulls"

#: The optional protocol of a serving peer backend that answers pulls of blocks its holder offered
#: in advance, without handing them to the holder (O1, contract 1.2).
OFFER_PULLS = "offer-pulls"


class OtherEnd(enum.Enum):
    PEER = "peer"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, declared once and never inferred.

    ``max_in_flight`` bounds the attempts that may be neither concluded nor quiesced at once;
    the next submission beyond it raises ``SubmissionRejected``. ``protocols`` names optional
    protocols (for example :data:`SERVE_PULLS`)."""

    contract_version: tuple[int, int]
    fetch: bool
    publish: bool
    memory_kinds: frozenset[MemoryKind]
    other_end: OtherEnd
    content_addressed: bool
    max_in_flight: int
    cancellation: bool
    protocols: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        version = tuple(self.contract_version)
        if len(version) != 2 or not all(isinstance(v, int) and v >= 0 for v in version):
            raise ValueError(f"contract_version must be (major, minor), got {self.contract_version!r}")
        object.__setattr__(self, "contract_version", version)
        for flag in ("fetch", "publish", "content_addressed", "cancellation"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"Capabilities.{flag} must be a bool, got {getattr(self, flag)!r}")
        if not (self.fetch or self.publish):
            raise ValueError("a backend must support fetch, publish or both")
        kinds = frozenset(self.memory_kinds)
        if not kinds or not all(isinstance(k, MemoryKind) for k in kinds):
            raise ValueError(f"memory_kinds must be a non-empty set of MemoryKind, got {self.memory_kinds!r}")
        object.__setattr__(self, "memory_kinds", kinds)
        if not isinstance(self.other_end, OtherEnd):
            raise TypeError(f"other_end must be an OtherEnd, got {self.other_end!r}")
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {self.max_in_flight!r}")
        protocols = frozenset(self.protocols)
        if not all(isinstance(p, str) and p for p in protocols):
            raise TypeError(f"protocols must be non-empty strings, got {self.protocols!r}")
        object.__setattr__(self, "protocols", protocols)

    def summary(self) -> str:
        """One line for tables and report headers."""
        dirs = "+".join(d for d in ("fetch", "publish") if getattr(self, d))
        kinds = ",".join(sorted(k.value for k in self.memory_kinds))
        extra = [p for p in sorted(self.protocols)]
        if self.content_addressed:
            extra.insert(0, "names")
        if self.cancellation:
            extra.insert(0, "cancel")
        return f"{self.other_end.value} {dirs} [{kinds}] queue={self.max_in_flight} " + " ".join(extra)
