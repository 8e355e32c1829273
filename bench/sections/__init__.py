"""The bench sections: one module each (or one module for a few sections that share a run), found by
``bench.registry.discover``."""
