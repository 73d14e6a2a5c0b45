"""`storage.is_storage_full` and the answer it decides (`errors.refusal_for`): a write refused
for want of room is `STORAGE_FULL`, also when raised `from` a wrapper; another error raised
while handling one (its `__context__` only) is that other error, an `INTERNAL_ERROR`.

The full disk is real: `/dev/full` answers every write with ENOSPC."""

from __future__ import annotations

import errno

import pytest

from control_plane.errors import InternalError, StorageFull, refusal_for
from control_plane.storage import is_storage_full


def _enospc() -> OSError:
    try:
        with open("/dev/full", "wb", buffering=0) as full:
            full.write(b"x")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return exc
    raise AssertionError("/dev/full accepted a write")


class _CleanupFailed(Exception):
    pass


def test_a_write_to_a_full_device_is_storage_full() -> None:
    error = _enospc()
    assert is_storage_full(error)
    assert isinstance(refusal_for(error), StorageFull)


def test_an_error_raised_from_a_full_disk_is_storage_full() -> None:
    with pytest.raises(_CleanupFailed) as raised:
        try:
            raise _enospc()
        except OSError as exc:
            raise _CleanupFailed("wrapped") from exc
    assert is_storage_full(raised.value)
    assert isinstance(refusal_for(raised.value), StorageFull)


def test_an_unrelated_error_while_handling_a_full_disk_is_not_storage_full() -> None:
    with pytest.raises(_CleanupFailed) as raised:
        try:
            raise _enospc()
        except OSError:
            # Implicit chaining is the point: the ENOSPC is only this error's __context__.
            raise _CleanupFailed("a bug in the cleanup")  # noqa: B904
    assert raised.value.__context__ is not None and raised.value.__cause__ is None
    assert not is_storage_full(raised.value)
    assert isinstance(refusal_for(raised.value), InternalError)
