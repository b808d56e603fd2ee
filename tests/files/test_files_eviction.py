"""Eviction and the store's other users: while an eviction unlinks the packs it removed, a get and
a put of another thread are answered (the store chose and uncounted the packs under its lock,
and unlinks them after letting it go), and what the put sees counts the removed packs as free."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FileStore, fs

from kvwire.blob import KeyStatus

OBJECT = 64 << 10
PACK = OBJECT + 16  # a pack of one object: its header, then the object
SMALL = 1 << 10


def _bytes(seed: int, size: int = OBJECT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _read(store: FileStore, key: str, size: int = OBJECT) -> tuple[KeyStatus, np.ndarray]:
    out = np.zeros(size, dtype=np.uint8)
    answer = store.read_batch([key], [memoryview(out)])
    assert answer is not None
    return answer[0][0], out


def test_a_get_and_a_put_are_answered_while_an_eviction_unlinks(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Room for four packs and a small object: the fifth pack evicts the oldest, and only that.
    store = FileStore(str(tmp_path / "store"), capacity_bytes=4 * PACK + 4 * SMALL)
    try:
        for k in range(4):
            assert store.write_from([f"k{k}"], [memoryview(_bytes(k))])[0] == [KeyStatus.OK]
        real_unlink = fs.unlink
        seen: list[tuple[bool, KeyStatus | None, KeyStatus | None, bool]] = []
        threads: list[threading.Thread] = []

        def others() -> tuple[KeyStatus, KeyStatus, bool]:
            status, got = _read(store, "k3")
            put = store.write_from(["small"], [memoryview(_bytes(9, SMALL))])[0][0]
            return status, put, bool(np.array_equal(got, _bytes(3)))

        def unlink(path: str) -> None:
            if "/packs/" in path and not seen:
                answers: list[tuple[KeyStatus, KeyStatus, bool]] = []
                other = threading.Thread(target=lambda: answers.append(others()), daemon=True)
                threads.append(other)
                other.start()
                other.join(30)  # a deadline for the other thread, which needs the store's lock
                seen.append((other.is_alive(), *(answers[0] if answers else (None, None, False))))
            real_unlink(path)

        monkeypatch.setattr(fs, "unlink", unlink)
        assert store.write_from(["k4"], [memoryview(_bytes(4))])[0] == [KeyStatus.OK]
        monkeypatch.undo()
        for other in threads:
            other.join(30)
        assert seen, "the fifth pack evicted nothing: this test showed nothing"
        blocked, got, put, whole = seen[0]
        assert not blocked, "a get and a put waited for the eviction's unlink (the store's lock was held over it)"
        assert (got, whole) == (KeyStatus.OK, True)
        assert put is KeyStatus.OK
        # The put found the removed pack's bytes free: it evicted nothing more.
        assert _read(store, "k0")[0] is KeyStatus.MISSING
        for k in range(1, 5):
            status, out = _read(store, f"k{k}")
            assert status is KeyStatus.OK and np.array_equal(out, _bytes(k)), k
        assert _read(store, "small", SMALL)[0] is KeyStatus.OK
        packs = list((tmp_path / "store" / "packs").iterdir())
        assert len(packs) == 5
        assert store.used_bytes == sum(p.stat().st_size for p in packs)
    finally:
        store.close()
