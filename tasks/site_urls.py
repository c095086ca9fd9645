"""Everything the package serves, under one prefix of your choosing::

    path("ops/", include("tasks.site_urls"))

gives ``ops/`` (redirects to the dashboard), ``ops/dashboard/`` (staff), ``ops/leases/`` (staff),
``ops/api/`` (the JSON API; ``ops/api/openapi.json`` describes it) and ``ops/metrics``
(Prometheus). The pieces, to mount apart or leave out:

- ``include("tasks.urls")``: the dashboard (URL namespace ``tasks``)
- ``include("leasing.urls")``: the lease pages (URL namespace ``leasing``)
- ``include("tasks.api_urls")``: the JSON API
- ``path("metrics", leasing.metrics.metrics_view, name="metrics")``: the metrics endpoint

The dashboard links to the lease pages and back, so those two go together (the templates reverse
``tasks:`` and ``leasing:`` names). It lives in ``tasks`` rather than ``leasing`` because it mounts
both apps: ``tasks`` already builds on ``leasing``, while ``leasing`` never imports ``tasks``.
"""

from __future__ import annotations

from django.urls import include, path
from django.views.generic import RedirectView

from leasing.metrics import metrics_view

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="tasks:overview", permanent=False), name="leasing-home"),
    path("dashboard/", include("tasks.urls")),
    path("leases/", include("leasing.urls")),
    path("api/", include("tasks.api_urls")),
    path("metrics", metrics_view, name="metrics"),
]
