"""The JSON API alone (leases and tasks, and the OpenAPI document at ``openapi.json``)::

    path("api/", include("tasks.api_urls"))

Unknown routes under it answer 404 in JSON, like every other API error. ``tasks.site_urls``
mounts this under ``api/`` together with the dashboard, the lease pages and the metrics.
"""

from __future__ import annotations

from leasing import api as lease_api
from tasks.web.api import tasks as task_api

urlpatterns = [*lease_api.urlpatterns, *task_api.urlpatterns, *task_api.fallback]
