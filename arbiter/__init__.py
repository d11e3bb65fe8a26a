"""hvarbiter: the VM/container I/O arbiter (docs/arbiter.md)."""

import os
import sys

# The arbiter runs from the source tree (hvarbiter, its tests, bench/): its
# QMP client is python/hvqmp.py there, which the libvirt hook shares.
_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), 'python')
if _PYTHON not in sys.path:
    sys.path.insert(0, _PYTHON)
