"""A project that mounts the pieces apart, at paths of its own, and leaves nothing at the root."""

from django.contrib import admin
from django.urls import include, path

from leasing.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("board/", include("tasks.urls")),
    path("board-leases/", include("leasing.urls")),
    path("v1/", include("tasks.api_urls")),
    path("prometheus/metrics", metrics_view, name="metrics"),
]
