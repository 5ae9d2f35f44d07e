"""The wire between ``lmkv serve`` and its clients, which both ends import: the framed protocol
(:mod:`~lmkv.wire.protocol`: frames, messages, the loopback rule) and same-host shared memory
(:mod:`~lmkv.wire.shm_window`: sealed memfds passed over a Unix socket). The server is
:mod:`lmkv.serve`, the client :mod:`lmkv.tiers.server_client`."""
