"""The app path every process of a Django worker imports: ``tether.contrib.django.worker_app:app``.

Importing it sets Django up (DJANGO_SETTINGS_MODULE), imports the installed apps' tasks
modules and gives the tether app of the backend named by TETHER_DJANGO_BACKEND: the
worker's main process and each spawned child run this same import. See worker.py.
"""

from __future__ import annotations

from tether.contrib.django.worker import load_worker_app

app = load_worker_app()
