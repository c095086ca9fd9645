"""The JSON API: tasks and the worker protocol (``tasks.py``), periodic tasks (``schedules.py``) and
the OpenAPI document (``openapi.py``)."""
