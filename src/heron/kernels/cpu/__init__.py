"""heron's native CPU kernels: C sources (``csrc/``) built per instruction set
(``isa``), loaded through ctypes (``library``), called as torch functions (``ops``)."""
