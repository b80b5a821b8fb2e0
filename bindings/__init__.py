"""cffi bindings of the native pykvcache API (installed as pykvcache._bindings)."""
