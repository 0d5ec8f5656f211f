"""Integrations with other frameworks; each is an optional extra (``tether[django]``)."""
