"""The cost model's parts, one file each: memory (and, to come, compute, communication, bubbles)."""
