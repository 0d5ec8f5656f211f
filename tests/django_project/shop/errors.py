class PaymentDeclined(Exception):
    """A task's own exception: its class path must come back through Django's API."""
