"""Data movers: each backend runs the agreed collectives on buffers of one kind of memory."""
