"""A small Django project for the tests of tether.contrib.django (tests/django)."""
