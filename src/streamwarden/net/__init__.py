"""The network client both the sidecar and the tools use: the upstream HTTP/1.1 client.

Here, not in the sidecar, so that ``streamwarden probe`` and the engine
watch reach an upstream without importing a face.
"""
