"""The host's link to a storage cluster, for the benchmarks that put the
cluster's daemons in a network namespace of their own (bench/boot-storm.py,
bench/full-clones.py): a veth pair between the machine and the namespace,
shaped with tbf on both ends, whose byte counters say what crossed it.

    link = Link('hvstorm', '10.77.0')      # namespace hvstorm, 10.77.0.1 <-> .2
    link.shape('1gbit')                    # both directions
    CephCluster(..., addr=link.ns_ip, netns=link.ns)
    link.sent_by_cluster()                 # bytes the namespace sent so far
    link.sent_by_host()                    # bytes the machine sent to it
    link.teardown()

Each benchmark gives its own namespace name and /24, so two of them can
run side by side."""

import re
import subprocess


def sh(*args, **kw):
    kw.setdefault('check', True)
    return subprocess.run([str(a) for a in args], capture_output=True,
                          text=True, **kw)


class Link:
    """The host's link to the cluster: a veth pair, tbf on both ends.
    ns: the namespace's name (also the stem of the interfaces' names:
    NS0 on the machine, NS1 in the namespace; at most 14 characters);
    net: the first three octets of the pair's /24 (machine .1, ns .2)."""

    def __init__(self, ns, net):
        self.ns = ns
        self.host_if, self.ns_if = f'{ns}0', f'{ns}1'
        self.host_ip, self.ns_ip = f'{net}.1', f'{net}.2'
        self.teardown()
        sh('ip', 'netns', 'add', ns)
        sh('ip', 'link', 'add', self.host_if, 'type', 'veth', 'peer', 'name', self.ns_if)
        sh('ip', 'link', 'set', self.ns_if, 'netns', ns)
        sh('ip', 'addr', 'add', f'{self.host_ip}/24', 'dev', self.host_if)
        sh('ip', 'link', 'set', self.host_if, 'up')
        self.in_ns('ip', 'addr', 'add', f'{self.ns_ip}/24', 'dev', self.ns_if)
        self.in_ns('ip', 'link', 'set', self.ns_if, 'up')
        self.in_ns('ip', 'link', 'set', 'lo', 'up')
        self.rate = None

    def in_ns(self, *args, **kw):
        """A command in the namespace (nsenter, not ip netns exec: that
        one also remounts /sys and hides cgroups)."""
        return sh('nsenter', f'--net=/run/netns/{self.ns}', *args, **kw)

    def shape(self, rate):
        for run, dev in ((sh, self.host_if), (self.in_ns, self.ns_if)):
            verb = 'change' if self.rate else 'add'
            run('tc', 'qdisc', verb, 'dev', dev, 'root', 'tbf', 'rate', rate,
                'burst', '256kb', 'latency', '100ms')
        self.rate = rate

    def sent_by_cluster(self):
        out = self.in_ns('tc', '-s', 'qdisc', 'show', 'dev', self.ns_if).stdout
        return int(re.search(r'Sent (\d+) bytes', out).group(1))

    def sent_by_host(self):
        out = sh('tc', '-s', 'qdisc', 'show', 'dev', self.host_if).stdout
        return int(re.search(r'Sent (\d+) bytes', out).group(1))

    def teardown(self):
        sh('ip', 'netns', 'del', self.ns, check=False)
        sh('ip', 'link', 'del', self.host_if, check=False)
