"""The bytes that cross between processes: segments, the slot ring, the in-slot allocator, the
descriptor codec, the wire messages, and the sweep of dead owners' segments.

The main process owns every segment (creates, grows, unlinks); workers only attach. See
docs/design/slot-lifecycle.md and docs/design/descriptor-protocol.md.
"""
