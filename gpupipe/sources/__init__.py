"""Everything that turns a source into the :class:`~gpupipe.sources.scan.ImageList` every backend reads: folders and
CSV lists (``scan``, ``walk``), tar shards (``shards``, read; ``publish``, written to a URL), object storage
(``remote``, ``objstore``, ``ranges``), the node's shard cache (``cache``, ``cache_folder``, ``cached``);
:func:`~gpupipe.sources.open.open_source` picks one."""
