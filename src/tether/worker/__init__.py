"""The worker: an asyncio main process that claims tasks and N child processes that run them."""
