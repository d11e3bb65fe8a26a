"""hvfiles: files our host programs write as root where a configuration
says, so that a planted symbolic link never turns one of those writes into
a write elsewhere (the arbiter's state and logs, hvvol's volume records).
"""

import os
import tempfile


def replace_file(path, text, mode=0o644, durable=False):
    """Write text as the whole new content of path: into a fresh file made
    beside it (O_EXCL, a random name: no link can stand there), then renamed
    over path (which replaces a link at path, never follows it).  durable:
    the file is synced before the rename and its directory after it, so that
    a crash leaves the old content or the new, complete."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix='.' + os.path.basename(path) + '.')
    try:
        with os.fdopen(fd, 'w') as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        except OSError:
            pass    # the rename is made; a directory sync error is not a rollback
        finally:
            os.close(dfd)
