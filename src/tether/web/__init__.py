"""The read-only web dashboard (`tether dashboard`)."""
