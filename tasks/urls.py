from django.urls import path

from tasks.web import bulk_pages as bulk_views
from tasks.web import dashboard as views
from tasks.web import history as history_views
from tasks.web import queue_pages as queue_views
from tasks.web import schedule_pages as schedule_views
from tasks.web import workflow_pages as workflow_views

app_name = "tasks"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("tasks/", views.every_task, name="tasks"),
    path("tasks/<int:task_id>/", views.task_detail, name="task-detail"),
    path("tasks/action/", views.task_action, name="task-action"),
    path("tasks/<int:task_id>/rerun-from-step/", views.task_rerun_from_step, name="task-rerun-from-step"),
    path("tasks/<int:task_id>/events/", views.task_send_event, name="task-send-event"),
    path("tasks/bulk/", bulk_views.bulk_operations, name="bulk"),
    path("tasks/bulk/<int:operation_id>/", bulk_views.bulk_detail, name="bulk-detail"),
    path("tasks/bulk/<int:operation_id>/cancel/", bulk_views.bulk_cancel, name="bulk-cancel"),
    path("tasks/<slug:state>/", views.task_list, name="task-state"),
    path("workers/", views.workers, name="workers"),
    # Worker ids are free text (host:pid:random by default): any character may appear.
    path("workers/<path:worker_id>/", views.worker_detail, name="worker-detail"),
    path("generator/", views.generator_page, name="generator"),  # 404 unless the demo app is installed
    path("queues/", queue_views.queues_page, name="queues"),
    path("history/", history_views.history_page, name="history"),
    path("schedules/", schedule_views.schedules, name="schedules"),
    path("schedules/<str:name>/", schedule_views.schedule_detail, name="schedule-detail"),
    path("workflows/", workflow_views.workflow_list, name="workflows"),
    path("workflows/<int:workflow_id>/", workflow_views.workflow_detail, name="workflow-detail"),
    path("workflows/<int:workflow_id>/cancel/", workflow_views.workflow_cancel, name="workflow-cancel"),
]
