"""The control API (FastAPI) and its HTTP client."""
