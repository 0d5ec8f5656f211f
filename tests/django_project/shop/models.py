"""What the tests observe: runs of task code, orders, and the signals workers sent."""

from __future__ import annotations

from django.db import models


class Run(models.Model):
    """One execution of a task's code (tests count them per token)."""

    token = models.CharField(max_length=64, db_index=True)
    task = models.CharField(max_length=200)
    attempt = models.IntegerField(default=0)
    pid = models.IntegerField()
    at = models.DateTimeField(auto_now_add=True)


class Order(models.Model):
    number = models.IntegerField(unique=True)
    state = models.CharField(max_length=20, default="new")


class SignalEvent(models.Model):
    """A task_started or task_finished signal, as a receiver in the worker saw it."""

    result_id = models.CharField(max_length=64, db_index=True)
    signal = models.CharField(max_length=20)
    status = models.CharField(max_length=20)
    attempts = models.IntegerField()
    worker_ids = models.JSONField()
