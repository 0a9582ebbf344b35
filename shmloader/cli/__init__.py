"""The command line behind ``python -m shmloader``.

``doctor`` (machine checks and the sweep of dead owners' segments; ``doctor_config``, its checks of
the ``SHMLOADER_*`` variables; ``findings``, what it reports); ``bench``, shmloader beside
torch's DataLoader in repeated rounds: :mod:`~shmloader.cli.bench` (the run), ``options`` (its
command line), ``measure`` (one measurement), ``workloads``, ``copylimit`` (the collate copy alone),
``records`` (records and the statistics over rounds), ``report`` (tables, JSON), ``plot``,
``progress``; and ``bench --train``: :mod:`~shmloader.cli.train` with ``trainstep`` (the model,
the step and its three feeds). :mod:`~shmloader.cli.interrupt`: the Ctrl-C handling every command
runs under."""
