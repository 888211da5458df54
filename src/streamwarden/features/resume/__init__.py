"""Resumable streams: positions and owners (:mod:`.model`), the store a face asks of
(:mod:`.store`, memory or :mod:`.redis_store`), and the resume service both faces
hold (:mod:`.service`).
"""
