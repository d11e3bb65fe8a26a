"""CPU time of processes and threads from /proc, for the benchmarks in this
directory (bench/redis-module.py, bench/app-assist.py)."""

import os


def stat_cpu(path):
    """(name, user + system CPU seconds) of a /proc/PID[/task/TID]/stat."""
    with open(path) as f:
        st = f.read()
    name, rest = st[st.index('(') + 1:st.rindex(')')], st[st.rindex(')') + 2:]
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def cpu_s(pid):
    """utime + stime of a process, seconds: its threads that ended too."""
    return stat_cpu(f'/proc/{pid}/stat')[1]


def thread_cpu(pid):
    """CPU seconds of each live thread of @pid, summed by thread name."""
    out = {}
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            name, t = stat_cpu(f'/proc/{pid}/task/{tid}/stat')
        except OSError:
            continue        # the thread ended meanwhile
        out[name] = out.get(name, 0) + t
    return out
