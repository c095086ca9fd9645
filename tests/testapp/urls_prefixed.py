"""A project that mounts the whole package under a prefix of its own, next to the admin."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("ops/", include("tasks.site_urls")),
]
