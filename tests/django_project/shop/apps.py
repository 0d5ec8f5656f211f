from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.django_project.shop"
    label = "shop"

    def ready(self) -> None:
        from tests.django_project.shop import receivers

        receivers.connect()
