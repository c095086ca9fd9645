from django.urls import path

from tasks import views

app_name = "tasks"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("tasks/<int:task_id>/", views.task_detail, name="task-detail"),
    path("tasks/action/", views.task_action, name="task-action"),
    path("tasks/<slug:state>/", views.task_list, name="task-state"),
    path("workers/", views.workers, name="workers"),
    # Worker ids are free text (host:pid:random by default): any character may appear.
    path("workers/<path:worker_id>/", views.worker_detail, name="worker-detail"),
    path("generator/", views.generator_page, name="generator"),
]
