"""hvlib: start real QEMU guests for our tests, demo and benchmarks.

Built on QEMU's own python package (build/qemu-src/python: qemu.machine, qemu.qmp).
"""
from .paths import BuildPaths, MissingBuild
from .vm import Console, Guest, GuestError, free_port, redis_client
from .migrate import migrate_postcopy, MigrationResult
from .redisdata import count_wrong, load_hot_cold, make_items
from .redisload import RedisLoad

__all__ = ['BuildPaths', 'MissingBuild', 'Console', 'Guest', 'GuestError', 'free_port', 'redis_client',
           'migrate_postcopy', 'MigrationResult',
           'count_wrong', 'load_hot_cold', 'make_items', 'RedisLoad']
