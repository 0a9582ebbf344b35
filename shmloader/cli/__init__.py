"""The command line behind ``python -m shmloader``: ``doctor`` (machine checks and the sweep of
dead owners' segments) and ``bench`` (shmloader beside torch's DataLoader, its workloads, and the
report and plot)."""
