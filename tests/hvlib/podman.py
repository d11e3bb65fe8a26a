"""Real OCI containers for tests and benchmarks: rootful podman with runc.

The settings are the ones this kind of host needs (../shared/PLATFORM.md and
docs/containers.md): runc (crun refuses a mixed v1/v2 cgroup layout), the
cgroupfs manager and file events (no systemd in CI), no default ulimits (the
host's hard open-files limit is below podman's default).  No registry is
reachable, so the image is made offline with mmdebstrap and imported once;
it is cached in the build directory by the package list that made it.

Podman's storage lives under the build directory, not /var/lib/containers:
tests never touch the host's own containers.
"""
import hashlib
import json
import os
import shutil
import subprocess

from .paths import BuildPaths

# What the test image holds: fio for I/O load, redis-server for a real server,
# e2fsprogs/util-linux for checks inside a container.
IMAGE_PACKAGES = ('fio', 'redis-server', 'e2fsprogs', 'procps')
IMAGE_NAME = 'localhost/hybridvm-test'


class PodmanMissing(Exception):
    """podman, runc or mmdebstrap is not installed: the caller skips."""


def _conf_text():
    return ('[containers]\n'
            'default_ulimits = []\n'
            '[engine]\n'
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n')


class Podman:
    """podman with this project's storage and settings.

    root: podman's graphroot (default <build>/podman/root); the image is
    imported into it on first use (image()).  extra_conf: text appended to
    the containers.conf (e.g. [engine.volume_plugins])."""

    def __init__(self, root=None, extra_conf='', paths=None):
        for tool in ('podman', 'runc'):
            if not shutil.which(tool):
                raise PodmanMissing(f'{tool} is not installed (scripts/setup-host.sh installs it)')
        self.paths = paths or BuildPaths()
        self.base = os.path.join(self.paths.build, 'podman')
        self.root = root or os.path.join(self.base, 'root')
        self.runroot = self.root + '.run'
        os.makedirs(self.root, exist_ok=True)
        conf_text = _conf_text() + extra_conf
        digest = hashlib.sha256(conf_text.encode()).hexdigest()[:12]
        self.conf = os.path.join(self.base, f'containers-{digest}.conf')
        if not os.path.exists(self.conf):
            tmp = self.conf + f'.{os.getpid()}'
            with open(tmp, 'w') as f:
                f.write(conf_text)
            os.replace(tmp, self.conf)

    def argv(self, *args):
        return ['podman', '--root', self.root, '--runroot', self.runroot,
                '--runtime', 'runc', '--cgroup-manager', 'cgroupfs',
                '--events-backend', 'file'] + [str(a) for a in args]

    def env(self):
        return dict(os.environ, CONTAINERS_CONF=self.conf)

    def run(self, *args, check=True, timeout=300, input=None):
        """podman ARGS; returns the CompletedProcess (text)."""
        p = subprocess.run(self.argv(*args), env=self.env(), capture_output=True,
                           text=True, timeout=timeout, input=input)
        if check and p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, p.args, p.stdout, p.stderr)
        return p

    def popen(self, *args, **kw):
        return subprocess.Popen(self.argv(*args), env=self.env(), **kw)

    def image(self):
        """The test image's name, importing it (made offline) on first use."""
        if self.run('image', 'exists', IMAGE_NAME, check=False).returncode == 0:
            return IMAGE_NAME
        tar = build_image_tar(self.paths)
        self.run('import', '--change', 'CMD=["/bin/sh"]', tar, IMAGE_NAME, timeout=600)
        return IMAGE_NAME

    def inspect(self, name):
        return json.loads(self.run('inspect', '--type', 'container', name).stdout)[0]

    def rm(self, *names):
        self.run('rm', '-f', '-t', '0', *names, check=False)


def build_image_tar(paths=None):
    """A Debian 12 minbase root with IMAGE_PACKAGES as a tar, made once."""
    if not shutil.which('mmdebstrap'):
        raise PodmanMissing('mmdebstrap is not installed (scripts/setup-host.sh installs it)')
    paths = paths or BuildPaths()
    key = hashlib.sha256(' '.join(IMAGE_PACKAGES).encode()).hexdigest()[:12]
    tar = os.path.join(paths.build, 'podman', f'rootfs-{key}.tar')
    if os.path.exists(tar):
        return tar
    os.makedirs(os.path.dirname(tar), exist_ok=True)
    tmp = tar[:-len('.tar')] + f'.{os.getpid()}.tar'   # mmdebstrap goes by the suffix
    p = subprocess.run(['mmdebstrap', '--variant=minbase', '--quiet',
                        '--include=' + ','.join(IMAGE_PACKAGES), 'bookworm', tmp],
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f'mmdebstrap failed: {p.stderr[-2000:]}')
    os.replace(tmp, tar)
    return tar
