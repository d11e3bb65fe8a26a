"""The arbiter's link errors, and its QMP client: python/hvqmp.py (the one
our host programs share; its docstring says why not qemu.qmp and which
bounds it keeps), with errors that are link errors.  What a command
returns is its caller's to check (vmlink.py)."""

import hvqmp


class LinkError(Exception):
    """The VM could not be asked (connect, timeout, garbage, closed): the
    link is dropped and made again later.  Also raised by the libvirt link
    (libvirtlink.py)."""


class LinkCommandError(LinkError):
    """The VM was asked and answered with an error: the link stays."""


class LinkProtocolError(LinkError):
    """The VM answered something that is not its protocol, or a reply not
    of the shape the command returns: the link is dropped and made again
    later, and the VM is in error meanwhile."""


class QMPError(hvqmp.QMPError, LinkError):
    """The VM could not be asked (connect, timeout, garbage, closed)."""


class QMPProtocolError(QMPError, hvqmp.QMPProtocolError, LinkProtocolError):
    """The peer sent what QMP does not."""


class QMPCommandError(QMPError, hvqmp.QMPCommandError, LinkCommandError):
    """QEMU answered with an error object: class and desc are QEMU's."""


class QMP(hvqmp.QMP):
    Error = QMPError
    ProtocolError = QMPProtocolError
    CommandError = QMPCommandError
    id_prefix = 'arb'
