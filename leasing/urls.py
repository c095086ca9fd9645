from django.urls import path

from leasing import views

app_name = "leasing"

urlpatterns = [
    path("", views.lease_list, name="lease-list"),
    path("<slug:state>/", views.lease_list, name="lease-state"),
]
