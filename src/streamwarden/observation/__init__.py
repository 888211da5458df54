"""What streamwarden tells about the streams: metrics, spans, log lines, the register.

:mod:`~streamwarden.observation.metrics` (Prometheus),
:mod:`~streamwarden.observation.telemetry` (OpenTelemetry),
:mod:`~streamwarden.observation.logs` (the stream's log line),
:mod:`~streamwarden.observation.register` (the open streams and their
slots), :mod:`~streamwarden.observation.live` (``GET /streams``) and
:mod:`~streamwarden.observation.top` (``streamwarden top``). Fed from the
core's records; imports no face.
"""
