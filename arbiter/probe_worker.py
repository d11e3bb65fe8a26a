"""The latency probe's process (sources.Probe starts it): 4 KiB O_DIRECT
reads at random aligned offsets of a device, IOPS a second, one at a time,
each timed around the system call and written to stdout as a line
"S <monotonic s> <latency s>"; "E <reason>" when a read fails; first a line
"P <policy>" naming the scheduling it runs under.  Samples go out in
batches, each at most FLUSH_S after it was taken; an error at once.

Why a process of its own, at SCHED_FIFO when it may: inside the daemon the
probe's thread, woken when its read completed, first waited for the GIL
and, on a busy 2-core host, for a CPU behind the guests' vCPU threads, so
its p99 timed its own wake-up more than the device (docs/arbiter.md,
"The probe").  A real-time thread that sleeps between reads takes the
next free CPU the moment its read completes.  At 200 reads a second it
used 2.1-2.5 % of a core here (bench/arbiter-scale.py, 2026-11-28): about
150 us a read, nearly all of it the kernel's two sleeps and wake-ups (the
read's, the pause's), 30-45 us each on this nested-virtualised host;
probe-iops scales it.

Usage: probe_worker.py DEVICE IOPS PARENT_PID.  It exits when its stdout
is closed or PARENT_PID is no longer its parent.
"""

import ctypes
import mmap
import os
import random
import sys
import time

BS = 4096
PR_SET_PDEATHSIG = 1
# Samples are written out together, each at most FLUSH_S after it was
# taken: the daemon's probe thread wakes for every write that reaches its
# pipe, and a flush after each sample woke it 200 times a second, 1.3 % of
# a core of the daemon's 2.2 % at a 100 ms period with one VM and one
# container (bench/arbiter-scale.py, 2026-11-27).  The daemon decides on a
# window of a second, every 50 ms at the shortest period.
FLUSH_S = 0.02
LIBC = ctypes.CDLL(None, use_errno=True)


# ioprio_set(2): a real-time task's I/O is in the real-time I/O class
# unless it says otherwise, and the device's scheduler (BFQ) then serves it
# first and idles the disk for its next read: the probe at SCHED_FIFO took
# a container's 4 KiB QD4 reads from 38k IOPS (p99 0.38 ms) to 19k (p99
# 5.7 ms).  Its reads must wait like a container's: best effort, level 4.
SYS_IOPRIO_SET = {'x86_64': 251, 'aarch64': 30}
IOPRIO_WHO_PROCESS = 1
IOPRIO_BE_4 = (2 << 13) | 4


def best_effort_io():
    nr = SYS_IOPRIO_SET.get(os.uname().machine)
    if nr is None:
        return False
    return LIBC.syscall(nr, IOPRIO_WHO_PROCESS, 0, IOPRIO_BE_4) == 0


def set_policy():
    """SCHED_FIFO priority 1 with best-effort I/O if both are allowed, else
    nice -10 if allowed, else as is."""
    if best_effort_io():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            return 'fifo'
        except (OSError, AttributeError):
            pass
    try:
        os.nice(-10)
        return 'nice-10'
    except OSError:
        return 'normal'


def main(argv):
    if len(argv) != 4:
        sys.stderr.write('usage: probe_worker.py DEVICE IOPS PARENT_PID\n')
        return 2
    path, iops, parent = argv[1], int(argv[2]), int(argv[3])
    if not 1 <= iops <= 100000:
        sys.stderr.write(f'probe_worker: IOPS {iops} out of range\n')
        return 2
    LIBC.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != parent:
        return 0
    out = sys.stdout
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        out.write(f'E {path}: cannot open for the latency probe: {e.strerror}\n')
        out.flush()
        return 1
    blocks = max(1, os.lseek(fd, 0, os.SEEK_END) // BS)
    buf = mmap.mmap(-1, BS)             # page-aligned, as O_DIRECT wants
    rnd = random.Random(0x5eed)
    interval = 1.0 / iops
    try:
        out.write(f'P {set_policy()}\n')
        out.flush()
        nxt = time.monotonic()
        held = None                     # when the oldest sample not written out was taken
        while os.getppid() == parent:
            off = rnd.randrange(blocks) * BS
            t0 = time.perf_counter()
            try:
                os.preadv(fd, [buf], off)
                lat = time.perf_counter() - t0
                now = time.monotonic()
                out.write(f'S {now:.6f} {lat:.9f}\n')
                if held is None:
                    held = now
            except OSError as e:
                out.write(f'E {path}: probe read at {off}: {e.strerror}\n')
                held = 0.0              # an error goes out at once
                nxt = time.monotonic() + 1.0
            nxt += interval
            now = time.monotonic()
            if nxt < now:
                nxt = now               # no catching up after a stall
            # out now, unless the next sample comes before this batch is due
            if held is not None and nxt - held >= FLUSH_S:
                out.flush()
                held = None
            time.sleep(max(0.0, nxt - now))
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        os.close(fd)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
