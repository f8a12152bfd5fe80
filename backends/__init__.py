"""Prefix-cache backends. Each module registers its class with `cachelib.register_backend`."""
