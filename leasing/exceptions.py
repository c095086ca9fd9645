"""One exception root for the app; each class's docstring is its default message."""

from __future__ import annotations


class LeasingError(Exception):
    """A leasing operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class LeaseAcquisitionError(LeasingError):
    """The lease is held by someone else and could not be acquired in time."""


class LeaseLost(LeasingError):
    """The lease was lost: it expired, was revoked, or was taken over by another holder."""


class StaleTokenError(LeasingError):
    """The write was rejected: a newer fencing token has already written to this row."""
