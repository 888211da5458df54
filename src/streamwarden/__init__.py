"""streamwarden keeps LLM token streams alive and honest between a model and a person."""

__version__ = "0.1.0"
