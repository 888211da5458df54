"""The tools around the proxy: the mock upstream, the probe, the injector, the demo.

:mod:`~streamwarden.tools.mock` (a simulated LLM upstream with faults),
:mod:`~streamwarden.tools.probe` (``streamwarden probe``: what a stream's
path does to it), :mod:`~streamwarden.tools.inject` and
:mod:`~streamwarden.tools.webhook` (fault injection in front of an
upstream) and :mod:`~streamwarden.tools.demo`. A tool may start a face
through its package, never reach inside it; nothing but the CLI imports a
tool.
"""
