"""Redis data sets with a known hot/cold split, for guests running our module."""
import random
import time

from .vm import GuestError


def make_items(count, size, seed=7, prefix='item:'):
    """`count` (key, value) pairs with seeded random values of `size` bytes."""
    rng = random.Random(seed)
    return [(f'{prefix}{i}', rng.randbytes(size)) for i in range(count)]


def load_hot_cold(client, data, hot_fraction, batch=5000, timeout=600):
    """Load `data` into Redis with our module, have the module demote every
    item, then read the first `hot_fraction` of them back (an access promotes
    an item to the keyspace).  Waits until the module has its app-assist port
    open.  Returns (hot, cold) lists of (key, value)."""
    for i in range(0, len(data), batch):
        client.mset(dict(data[i:i + batch]))
    tuning = {'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1}
    defaults = {k: client.config_get(f'appassist.{k}')[f'appassist.{k}'] for k in tuning}
    for k, v in tuning.items():
        client.config_set(f'appassist.{k}', v)
    deadline = time.monotonic() + timeout
    while client.info('appassist')['appassist_cold_items'] < len(data):
        client.execute_command('APPASSIST.DEMOTE', batch)
        if time.monotonic() > deadline:
            raise GuestError(f'demotion did not finish in {timeout} s')
    client.config_set('appassist.demote', 'no')
    nhot = int(len(data) * hot_fraction)
    hot, cold = data[:nhot], data[nhot:]
    for i in range(0, nhot, batch):
        client.mget([k for k, _ in hot[i:i + batch]])
    # Back to the module's defaults (demotion stays off): what is measured
    # next is a server in service, not the loader's 1 ms timer.
    for k, v in defaults.items():
        client.config_set(f'appassist.{k}', v)
    cold_now = client.info('appassist')['appassist_cold_items']
    if cold_now != len(cold):
        raise GuestError(f'{cold_now} cold items after reading the hot ones back, expected {len(cold)}')
    deadline = time.monotonic() + 30
    while client.info('appassist')['appassist_port_connected'] != 1:
        if time.monotonic() > deadline:
            raise GuestError('the Redis module did not open its app-assist port')
        time.sleep(0.2)
    return hot, cold


def _mget(client, keys, attempts=5, pause=1.0):
    """MGET that outlives a client-library error (a reply cut short, a
    timeout while the destination still pulls pages): retried with a pause,
    redis-py reconnecting; None when every attempt failed."""
    for i in range(attempts):
        try:
            return client.mget(keys)
        except Exception:  # noqa: BLE001 -- whatever the library raises
            if i + 1 < attempts:
                time.sleep(pause)
    return None


def count_wrong(client, hot, cold, cold_dropped, batch=5000, cold_sample=5000):
    """(hot items whose value is not the expected one, cold items in a sample
    that are not as expected: misses when `cold_dropped`, else their values).
    An item that could not be read at all counts as wrong."""
    wrong = 0
    for i in range(0, len(hot), batch):
        chunk = hot[i:i + batch]
        got = _mget(client, [k for k, _ in chunk])
        if got is None:
            wrong += len(chunk)
            continue
        wrong += sum(1 for (_, v), g in zip(chunk, got) if g != v)
    sample = cold[:cold_sample]
    got = _mget(client, [k for k, _ in sample]) if sample else []
    if got is None:
        return wrong, len(sample)
    if cold_dropped:
        wrong_cold = sum(1 for g in got if g is not None)
    else:
        wrong_cold = sum(1 for (_, v), g in zip(sample, got) if g != v)
    return wrong, wrong_cold
