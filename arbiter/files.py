"""Files the arbiter writes as root where its configuration says: a
planted symbolic link must never turn one of those writes into a write
elsewhere."""

import os
import tempfile


def replace_file(path, text, mode=0o644):
    """Write text as the whole new content of path: into a fresh file made
    beside it (O_EXCL, a random name: no link can stand there), then
    renamed over path (which replaces a link at path, never follows it)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix='.' + os.path.basename(path) + '.')
    try:
        with os.fdopen(fd, 'w') as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_append(path, mode=0o640):
    """path opened for appending lines, created if missing, refused (ELOOP)
    if it is a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    os.fchmod(fd, mode)
    return os.fdopen(fd, 'a', buffering=1)
