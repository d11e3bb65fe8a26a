"""The arbiter's watchdog: started by the daemon in a session of its own,
with stdin the read end of a pipe only the daemon writes.  When the pipe
closes (the daemon exited, was killed, crashed) without a "done" line, it
puts every VM's default limits back, so that no VM stays throttled by a
controller that is gone.  It prints "ready" once it has read the
configuration; until the daemon is gone its errors go to its stderr, a
pipe the daemon reads (its status shows the last one), and then to the
daemon's own stderr, which it was given as descriptor STDERR_FD.
Usage: python3 -m arbiter.watchdog CONFIG [STDERR_FD]
"""

import os
import sys
import time

from .config import Config, ConfigError
from .daemon import DecisionLog
from .vmlink import restore_defaults

ATTEMPTS = 5


def main():
    conf = Config(sys.argv[1])
    try:
        os.write(1, b'ready\n')
    except OSError:
        pass            # a daemon gone already: stdin says so below
    data = b''
    while True:
        d = sys.stdin.buffer.read(64)
        if not d:
            break
        data = (data + d)[-64:]
    # the daemon, which read our stdout and stderr, is gone
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(int(sys.argv[2]) if len(sys.argv) > 2 else null, 2)
    if b'done' in data:
        return 0
    log = DecisionLog(conf.log, conf.log_max)
    log(dict(event='watchdog', why='the daemon went away without restoring the defaults'))
    for i in range(ATTEMPTS):
        res = restore_defaults(conf, conf.qmp_timeout, log)
        # a VM that is gone has nothing to restore; one that hangs may come back
        left = [n for n, e in res.items() if e and 'cannot connect' not in e]
        if not left:
            break
        time.sleep(1 + i)
    log.close()
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except ConfigError as e:
        sys.exit(f'hvarbiter watchdog: {e}')
