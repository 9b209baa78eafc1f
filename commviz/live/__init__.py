"""While the job runs: the always-on record read live (windows, ``commviz watch``, Prometheus).

Nothing here runs inside a rank's training loop: each reader is a separate process that follows
the ranks' journals, so a reader that dies, hangs or is flooded never slows or stops a rank.
"""
