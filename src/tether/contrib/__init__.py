"""Adapters to other libraries (each an optional extra): tether.contrib.sqlalchemy, tether.contrib.django."""
