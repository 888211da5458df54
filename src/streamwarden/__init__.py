"""streamwarden keeps LLM token streams alive and honest between a model and a person."""

from streamwarden import _moved, _native

# Before any other module of the package: which of the per-event modules run
# compiled, and which from source (see streamwarden/_native.py), and the old
# flat module names as aliases of their new homes (streamwarden/_moved.py).
_native.choose()
_moved.install()

__version__ = "0.1.0"
