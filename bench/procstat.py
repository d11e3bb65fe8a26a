"""CPU time of processes and threads from /proc, for the benchmarks in this
directory (bench/redis-module.py, bench/app-assist.py, bench/arbiter-scale.py)."""

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


def children(pid):
    """The pids of @pid's live children (/proc/PID/task/*/children)."""
    out = []
    try:
        tids = os.listdir(f'/proc/{pid}/task')
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f'/proc/{pid}/task/{tid}/children') as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


def tree_cpu_s(pid):
    """(the process's own CPU seconds, its descendants'): own is utime +
    stime of @pid; descendants' those of every live descendant plus what
    its reaped children used (cutime + cstime, which counts theirs)."""
    with open(f'/proc/{pid}/stat') as f:
        st = f.read()
    fields = st[st.rindex(')') + 2:].split()
    tck = os.sysconf('SC_CLK_TCK')
    own = (int(fields[11]) + int(fields[12])) / tck
    desc = (int(fields[13]) + int(fields[14])) / tck
    todo = children(pid)
    while todo:
        c = todo.pop()
        try:
            with open(f'/proc/{c}/stat') as f:
                st = f.read()
        except OSError:
            continue        # it ended meanwhile (and its parent reaps it)
        fields = st[st.rindex(')') + 2:].split()
        # its own and what its reaped children used; its live ones follow
        desc += sum(int(fields[i]) for i in (11, 12, 13, 14)) / tck
        todo += children(c)
    return own, desc
