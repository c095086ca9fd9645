"""Leases with fencing tokens for Django on PostgreSQL.

``from leasing import lease, LeaseAcquisitionError, LeaseLost``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leasing.exceptions import LeaseAcquisitionError, LeaseLost, LeasingError, StaleTokenError

if TYPE_CHECKING:
    from leasing.holder import LeaseHolder, lease

__all__ = ["LeaseAcquisitionError", "LeaseHolder", "LeaseLost", "LeasingError", "StaleTokenError", "lease"]


def __getattr__(name: str) -> Any:
    # The holder imports models, which need the app registry; load it on first use.
    if name in ("lease", "LeaseHolder"):
        from leasing import holder

        return getattr(holder, name)
    raise AttributeError(f"module 'leasing' has no attribute {name!r}")
