"""A user table protected by fencing, as an application would write it."""

from django.db import models

from leasing.fencing import FencedModel


class FencedRecord(FencedModel):
    key = models.CharField(max_length=100, unique=True)
    value = models.TextField(default="")
    writes = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.key


class Gate(models.Model):
    """A switch the tests open to let a blocked task handler finish."""

    key = models.CharField(max_length=100, unique=True)
    open = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.key


class Effect(models.Model):
    """One row per side effect of a task handler, to count executions."""

    task_id = models.BigIntegerField(db_index=True)
    token = models.BigIntegerField()
    attempt = models.PositiveIntegerField()
    phase = models.CharField(max_length=20)
    pid = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.task_id}:{self.phase}"


class Once(models.Model):
    """A side effect with a unique key: a second run of the same effect inserts nothing (the
    workflow tests count how many times a callback's effect happened)."""

    key = models.CharField(max_length=100, unique=True)
    value = models.JSONField(default=dict)
    runs = models.PositiveIntegerField(default=1)

    def __str__(self) -> str:
        return self.key
