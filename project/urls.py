from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from leasing import api as lease_api
from leasing.metrics import metrics_view
from tasks import api as task_api

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="tasks:overview", permanent=False)),
    path("admin/", admin.site.urls),
    path("dashboard/", include("tasks.urls")),
    path("leases/", include("leasing.urls")),
    path("api/", include(lease_api.urlpatterns + task_api.urlpatterns + task_api.fallback)),
    path("metrics", metrics_view, name="metrics"),
]
