"""``streamwarden probe``: what a stream's path does to it (:mod:`.measure`, no I/O),
its HTTP client (:mod:`.client`) and the picture it draws (:mod:`.plot`).
"""
