"""A relay with the transforms its stages would give it, without a face: for tests and benches.

The pipeline gives a stream its transforms from the route and the request
(:meth:`streamwarden.pipeline.Pipeline.open`); :func:`with_transforms` does
the same for a relay made on its own, in the plan's order.
"""

from __future__ import annotations

from streamwarden.core.filters import FilterSet
from streamwarden.core.journal import Journal
from streamwarden.core.relay import Relay
from streamwarden.core.transform import EventTransform, TransformChain
from streamwarden.core.usage import UsageRole
from streamwarden.pipeline.holdback import FilterHoldback
from streamwarden.pipeline.stamping import JournalStamps
from streamwarden.pipeline.takeback import usage_transform

__all__ = ["with_transforms"]


def with_transforms(
    relay: Relay,
    *,
    usage: UsageRole = None,
    filters: FilterSet | None = None,
    max_held_bytes: int | None = None,
    journal: Journal | None = None,
) -> Relay:
    """``relay`` with usage take-back, output filters and a journal, as their stages give them."""
    transforms: list[EventTransform] = []
    taking = usage_transform(usage)
    if taking is not None:
        transforms.append(taking)
    if filters is not None:
        held = relay.limits.max_event_bytes if max_held_bytes is None else max_held_bytes
        transforms.append(FilterHoldback(relay, filters, held))
    if journal is not None:
        transforms.append(JournalStamps(journal))
    if transforms:
        chain = relay.chain
        given = (*(chain.transforms if chain is not None else ()), *transforms)
        relay.chain = TransformChain(given, relay.meter)
    return relay
