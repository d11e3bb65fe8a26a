"""The control law (docs/arbiter.md has the maths): a pure function of one
period's measurements and the previous limits, so that it can be tested on
its own.

Each period the containers' latency is compared with its target, as a ratio
r = L / target, L the probe's latency at target-percentile (and, with target-pressure, the larger of that and the
PSI stall share over its target):
  r > 1           cut every controllable VM's IOPS limit by s = clamp(g(r-1))
  r < LOW         raise every throttled VM's limit by s = clamp(g(LOW-r))
  LOW <= r <= 1   hold (the hysteresis band)
with s in [STEP_MIN, STEP_MAX] = [1 %, 16 %] (iocost's vrate steps), never
below the VM's floor, never above its default.  Containers idle for
IDLE_PERIODS periods: every VM goes back to its default (work-conserving).
A VM over its own latency SLO while its throttle is what holds it back is
not cut further; it is raised by STEP_MIN instead.
"""

STEP_MIN, STEP_MAX, GAIN = 0.01, 0.16, 0.5
LOW = 0.85
IDLE_PERIODS = 3
LIFT_FACTOR = 2.0       # a raised limit this far above free running: lift it


def clamp_step(x):
    return max(STEP_MIN, min(STEP_MAX, GAIN * x))


class VMState:
    """What the policy keeps about one VM between periods."""

    def __init__(self, conf):
        self.conf = conf
        self.limit = None           # IOPS limit set by us; None: the default
        self.free_iops = 0.0        # its IOPS the last time it ran at its default
        self.req_bytes = 4096.0     # mean request size (EWMA)

    def floor(self):
        """The least IOPS limit: the configured floor, and enough I/Os of
        the VM's mean size to carry the bytes floor (2 MB/s of 4 KiB
        requests is 488 of them; of 1 MiB requests, 2)."""
        c = self.conf
        return max(float(c.floor_iops), c.floor_bps / max(512.0, self.req_bytes))

    def limits(self):
        """The throttle group's limits for self.limit (None: the default)."""
        c = self.conf
        if self.limit is None:
            return c.default_limits()
        bps = max(c.floor_bps, int(self.limit * self.req_bytes))
        if c.default_bps:
            bps = min(bps, c.default_bps)
        return {'iops-total': int(self.limit), 'bps-total': int(bps)}


def containers_idle(cont, idle_iops):
    """Whether the containers did (almost) no I/O this period and did not
    stall on it."""
    return cont['iops'] <= idle_iops and not (cont.get('pressure') or 0) > 0.01


def decide(states, vm_in, cont, target_ms, target_pressure, idle_iops, idle_count):
    """One period.  states: name -> VMState (updated in place);
    vm_in: name -> dict(iops, bytes_per_op, p99_ms) for the VMs measured this
    period (absent: unreachable, left alone); cont: dict(iops, lat_ms,
    pressure), lat_ms at the target's percentile.  Returns (action, ratio, idle_count, per-VM notes)."""
    for name, m in vm_in.items():
        st = states[name]
        if m.get('bytes_per_op'):
            st.req_bytes = 0.7 * st.req_bytes + 0.3 * m['bytes_per_op']
        if st.limit is None and m['iops'] > 0:
            st.free_iops = max(0.5 * st.free_iops, m['iops'])
    notes = {}
    if containers_idle(cont, idle_iops):
        idle_count += 1
        if idle_count >= IDLE_PERIODS:
            lifted = False
            for name in vm_in:
                if states[name].limit is not None:
                    states[name].limit = None
                    notes[name] = 'lift'
                    lifted = True
            return ('lift' if lifted else 'idle'), None, idle_count, notes
        return 'idle', None, idle_count, notes
    idle_count = 0
    ratios = []
    if cont.get('lat_ms') is not None and target_ms:
        ratios.append(cont['lat_ms'] / target_ms)
    if target_pressure and cont.get('pressure') is not None:
        ratios.append(cont['pressure'] / target_pressure)
    if not ratios:
        return 'hold', None, idle_count, {'*': 'no container latency this period'}
    r = max(ratios)
    if r > 1.0:
        s = clamp_step(r - 1.0)
        action = 'cut'
        for name, m in vm_in.items():
            st, c = states[name], states[name].conf
            cur = st.limit if st.limit is not None else max(m['iops'], st.floor())
            lat, kind = vm_latency(m)
            if lat is not None and lat > c.slo_p99_ms:
                why = f'over its SLO ({kind} {lat:.1f} > {c.slo_p99_ms:g} ms)'
                if st.limit is None:
                    notes[name] = why + ': not cut'
                else:
                    st.limit = cap(c, cur * (1 + STEP_MIN))
                    notes[name] = why + ': raised'
                continue
            new = max(st.floor(), cur * (1 - s))
            if c.default_iops:
                new = min(new, c.default_iops)
            notes[name] = 'at floor' if new <= st.floor() else f'-{s * 100:.0f}%'
            st.limit = new
    elif r < LOW:
        s = clamp_step(LOW - r)
        action = 'raise'
        for name, m in vm_in.items():
            st, c = states[name], states[name].conf
            if st.limit is None:
                continue
            new = st.limit * (1 + s)
            ceiling = c.default_iops or LIFT_FACTOR * max(st.free_iops, st.floor())
            if new >= ceiling:
                st.limit = None
                notes[name] = 'back to its default'
            else:
                st.limit = new
                notes[name] = f'+{s * 100:.0f}%'
    else:
        action = 'hold'
    return action, r, idle_count, notes


def vm_latency(m):
    """The VM latency its SLO is checked against, and its kind: the p99 of
    QEMU's histogram, or where there is none (a VM libvirt manages: libvirt
    gives only the total time of a disk's requests) their mean, a weaker
    check."""
    if m.get('p99_ms') is not None:
        return m['p99_ms'], 'p99'
    if m.get('mean_ms') is not None:
        return m['mean_ms'], 'mean'
    return None, None


def cap(c, v):
    return min(v, c.default_iops) if c.default_iops else v


def weighted_work(cont_bps, vm_bps, gap):
    """Total work in 4 KiB I/Os a second (bytes / 4096, as QEMU's iops-size
    and iocost's page cost count large requests), a VM's counting 'gap'
    times: the VM path reaches 1/gap of what the container path does on the
    same device, so each side alone at its own ceiling scores alike."""
    return (cont_bps + gap * vm_bps) / 4096
