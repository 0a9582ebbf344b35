"""What runs inside a worker process: its main loop (``main``) and the fetchers (``fetch``).

Nothing here runs in the main process except ``make_fetcher``/``run_collate``, which the
single-process iterator reuses so ``num_workers=0`` fetches and collates exactly as a worker does.
"""
