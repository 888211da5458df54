"""Features that keep state beyond one stream, for both faces.

:mod:`~streamwarden.features.resume`: resumable streams and their stores
(memory, Redis); :mod:`~streamwarden.features.engine`: the inference
engine's own counters, scraped and reconciled with the streams. A
feature imports the core and observation, never a face; the pipeline's
stages (:mod:`streamwarden.pipeline`) bring them to every stream.
"""
