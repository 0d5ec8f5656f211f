#!/usr/bin/env python
"""manage.py of the test project (run from the repository's root by the tests)."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # A project's manage.py sits in the folder its settings are imported from; this one
    # lives two levels down, so it puts the repository's root on the path itself.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
