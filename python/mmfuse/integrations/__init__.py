"""Integrations of mmfuse with other libraries (each imported on demand)."""
