from django.apps import AppConfig


class ConformanceRecorderConfig(AppConfig):
    """Only in the conformance worker process: records its django.tasks signals and logs."""

    name = "tests.conformance"
    label = "conformance"

    def ready(self) -> None:
        from tests.conformance.recorder import attach_from_environment

        attach_from_environment()
