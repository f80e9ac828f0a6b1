"""Scheduling requests onto instances: the dynamic batcher and its queue, the sequence batcher, adaptive batching."""
