"""hvvol: hybrid volumes for containers (docs/containers.md).

A hybrid image (docs/hybrid.md) served by its own qemu-storage-daemon,
exported as a block device, formatted on first use and mounted; and the
reverse without losing a byte.  The library (volume.hvvol.Volumes) is what
the `hvvol` command and podman's volume plugin (plugin.py, `hvvol plugin`) both
drive.
"""

import os
import sys

# Our host programs run from the tree on the system Python; the QMP client
# they share is python/hvqmp.py.
_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), 'python')
if _PYTHON not in sys.path:
    sys.path.insert(0, _PYTHON)
