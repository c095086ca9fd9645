"""Signals sent on lease transitions.

Every signal is sent with ``sender`` set to the model class and ``grant`` (a :class:`~leasing.models.Grant`).
``lease_lost`` also carries ``reason``.
"""

from __future__ import annotations

from django.dispatch import Signal

lease_acquired = Signal()
lease_renewed = Signal()
lease_released = Signal()
lease_lost = Signal()
