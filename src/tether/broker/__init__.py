"""Every SQL statement tether runs, and the broker that runs them."""

from tether.broker.broker import PostgresBroker

__all__ = ["PostgresBroker"]
