"""Model resolution for pykvcache (installed as pykvcache._models)."""
