"""Tiers: where a page lives. Each implements :class:`lmkv.tiers.base.Tier`."""
