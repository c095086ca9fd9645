"""A user table protected by fencing, as an application would write it."""

from django.db import models

from leasing.fencing import FencedModel


class FencedRecord(FencedModel):
    key = models.CharField(max_length=100, unique=True)
    value = models.TextField(default="")
    writes = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.key
