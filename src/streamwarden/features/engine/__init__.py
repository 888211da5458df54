"""The inference engine's own counters: read from its Prometheus text (:mod:`.counters`,
no I/O) and scraped and reconciled with the open streams (:mod:`.watch`).
"""
