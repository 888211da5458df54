"""The streamwarden benchmark harness: ``python -m bench run [--quick]``.

See ``bench/README.md`` for what it measures and how to read its results.
"""
