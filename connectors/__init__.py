"""Engine adapters: thin translations between an engine's API and :mod:`lmkv`."""
