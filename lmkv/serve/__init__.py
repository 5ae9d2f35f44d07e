"""``lmkv serve``, the cache server many engines share, and its wire: the framed protocol
(``protocol``), same-host shared memory (``shm_window``), who gets a connection (``admission``)
and what a token grants (``tenants``). The client end is :mod:`lmkv.tiers.server_client`."""
