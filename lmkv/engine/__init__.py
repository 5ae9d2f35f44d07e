"""The engine-facing half of lmkv, engine-agnostic: what a connector calls each step.

- :mod:`~lmkv.engine.scheduler` decides (lookups, loads, stores, finalization, failures) in
  keys and block ids; no bytes move there.
- :mod:`~lmkv.engine.worker` moves bytes: it executes a step's :mod:`~lmkv.engine.plan`
  layer by layer, through :mod:`~lmkv.engine.blockcopy` (or :mod:`lmkv.kernels` on a GPU).
- :mod:`~lmkv.engine.sequence` turns a request's tokens into page chains,
  :mod:`~lmkv.engine.residency` mirrors workers' memory for a scheduler in another process,
  :mod:`~lmkv.engine.stores` shares one store between a process's scheduler and worker.

Nothing here imports an engine; :mod:`lmkv.connectors` translates an engine's calls into these.
"""
