from django.contrib import admin
from django.urls import include, path

# The demo mounts the package at the root: /dashboard/, /leases/, /api/, /metrics (and / redirects
# to the dashboard). A project of your own picks a prefix: path("ops/", include("tasks.site_urls")).
urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("tasks.site_urls")),
]
