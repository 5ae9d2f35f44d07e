"""``lmkv serve``, the cache server many engines share: one connection's requests
(``connection``), the listener and its admission of connections (``server``, ``admission``) and
what a token grants (``tenants``). Its wire is :mod:`lmkv.wire`; the client end is
:mod:`lmkv.tiers.server_client`."""
