"""Attention backends behind one interface (``backend.py``), chosen by name in
``registry.py``: torch (CPU, with heron's C decode kernel) and Triton (CUDA)."""
