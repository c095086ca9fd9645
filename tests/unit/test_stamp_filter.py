"""The pages' one time format (leasing/templatetags/leasing_tags.py ``stamp``) on every Python the
README names: a time with no zone (an error entry's "at" written without an offset, a naive datetime)
reads as UTC. (On Python 3.10, ``datetime.UTC`` does not exist: such a time raised AttributeError and
its page rendered a 500.)"""

from __future__ import annotations

import datetime as dt

from django.test import override_settings

from leasing.templatetags.leasing_tags import stamp


@override_settings(TIME_ZONE="UTC", USE_TZ=True)
def test_a_time_with_no_zone_reads_as_utc() -> None:
    assert stamp(dt.datetime(2026, 11, 25, 16, 4, 5)) == "2026-11-25 16:04:05 UTC"
    assert stamp("2026-11-25T16:04:05") == "2026-11-25 16:04:05 UTC"
    assert stamp("2026-11-25T16:04:05+00:00") == "2026-11-25 16:04:05 UTC"
    assert stamp(None) == ""
