"""The test project's app: a model, its tasks and signal receivers."""
