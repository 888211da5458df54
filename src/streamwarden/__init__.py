"""streamwarden keeps LLM token streams alive and honest between a model and a person."""

from streamwarden import _native

# Before any other module of the package: which of the per-event modules run
# compiled, and which from source (see streamwarden/_native.py). Nothing
# else happens at import: no finder, handler or hook of any other kind.
_native.choose()

__version__ = "0.1.0"
