"""A task outside the app's tasks module: a worker does not import it at start, and finds it
when a row names it (its module is in an installed app's package)."""

from __future__ import annotations

from django.tasks import task

from tests.django_project.shop.models import Run


def helper(token: str) -> str:
    """Not a task: a row naming it must not run it."""
    return token


@task
def lazy_job(token: str) -> str:
    import os

    Run.objects.create(token=token, task="lazy_job", pid=os.getpid())
    return "found"
