"""docs/containers.md runs as written.

Every ```sh block of the document is a command a reader may type; they
run here in order as one script (sh -eu), unless the line before the block
is an HTML comment `<!-- not run: REASON -->`.  The script runs in a private
mount namespace with /srv, /run/hybridvm and /run/containers on tmpfs (the
document's paths), with the document's environment variables pointing at
this test's directories and broker, hvvol and the build's qemu-img on PATH.
Podman runs with the document's containers.conf snippet (the toml block
that names the volume plugin) merged into this project's podman settings
(tests/hvlib/podman.py), a storage of the test's own (CONTAINERS_STORAGE_CONF)
and the offline-made test image imported there under the name the document
uses.  Afterwards no volume is left and no daemon runs."""

import json
import os
import subprocess
import sys
import tomllib
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import privatens                            # noqa: E402
from vollib import TOP, VolumeTest          # noqa: E402
from volume import host                     # noqa: E402
from hvlib import podman as hvpodman        # noqa: E402
from hvlib import docblocks                  # noqa: E402
from hvlib.docblocks import blocks          # noqa: E402

sys.path.insert(0, os.path.join(TOP, 'broker', 'tests'))
import brokerlib as B                       # noqa: E402

DOC = os.path.join(TOP, 'docs', 'containers.md')
DOC_IMAGE = 'docker.io/library/debian:bookworm'


def toml_text(table, prefix=''):
    """A TOML document of nested tables of strings, numbers, booleans and
    lists (what containers.conf holds)."""
    out = [f'[{prefix}]'] if prefix else []
    subs = []
    for key, val in table.items():
        if isinstance(val, dict):
            subs.append((key, val))
        else:
            out.append(f'{key} = {json.dumps(val)}')
    for key, val in subs:
        out.append(toml_text(val, f'{prefix}.{key}' if prefix else key))
    return '\n'.join(out) + '\n'


def merged(base, extra):
    out = dict(base)
    for key, val in extra.items():
        out[key] = merged(out.get(key, {}), val) if isinstance(val, dict) else val
    return out


class DocTest(VolumeTest):

    def test_blocks_are_marked(self):
        """Each sh block runs, or says why not; there are blocks to run."""
        found = blocks(DOC)
        sh = [b for b in found if b.lang == 'sh']
        self.assertGreaterEqual(len([b for b in sh if b.not_run_reason is None]), 5)
        for lang, body, _, reason in found:
            self.assertIn(lang, ('sh', 'text', 'toml'), f'a block in {lang!r}: {body[:60]!r}')
            if lang == 'toml':
                tomllib.loads(body)
            if reason is not None:
                self.assertGreater(len(reason), 20, 'a reason, not a word')

    def podman_env(self, found):
        """CONTAINERS_CONF: the project's podman settings with the document's
        containers.conf snippet merged in; CONTAINERS_STORAGE_CONF: a storage
        of this test's own holding the test image as DOC_IMAGE."""
        snippets = [b.body for b in found
                    if b.lang == 'toml' and 'volume_plugins' in b.body]
        self.assertEqual(len(snippets), 1, 'one containers.conf snippet')
        conf = merged(tomllib.loads(hvpodman._conf_text()), tomllib.loads(snippets[0]))
        conf_path = os.path.join(self.tmp, 'containers.conf')
        with open(conf_path, 'w') as f:
            f.write(toml_text(conf))
        storage = os.path.join(self.tmp, 'podman')
        storage_conf = os.path.join(self.tmp, 'storage.conf')
        with open(storage_conf, 'w') as f:
            f.write(toml_text({'storage': {'driver': 'overlay',
                                           'graphroot': os.path.join(storage, 'root'),
                                           'runroot': os.path.join(storage, 'run')}}))
        env = dict(CONTAINERS_CONF=conf_path, CONTAINERS_STORAGE_CONF=storage_conf)
        try:
            tar = hvpodman.build_image_tar()
        except hvpodman.PodmanMissing as exc:
            self.skipTest(str(exc))
        p = subprocess.run(['podman', 'import', '--change', 'CMD=["/bin/sh"]', tar, DOC_IMAGE],
                           env=dict(os.environ, **env), capture_output=True, text=True,
                           timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr)
        return env

    def test_commands_run_as_written(self):
        found = blocks(DOC)
        try:
            hvpodman.Podman()
        except hvpodman.PodmanMissing as exc:
            self.skipTest(str(exc))
        privatens.enter()       # podman's mounts of the import stay in it
        podman_env = self.podman_env(found)
        pool = os.path.join('/dev/shm', os.path.basename(self.tmp) + '-pool')
        broker = B.Broker(self.tmp, pool)
        broker.start()
        try:
            env = dict(os.environ, HVVOL_DIR=self.conf, HVVOL_RUN_DIR=self.run_dir,
                       HVMEM_SOCKET=broker.sock, **podman_env,
                       PATH=os.pathsep.join([os.path.join(TOP, 'volume'),
                                             os.path.dirname(self.vols.tools.qemu_img),
                                             os.environ.get('PATH', '/usr/bin:/bin')]))
            p = docblocks.run(DOC, env=env, timeout=900,
                              tmpfs=[('/srv', 'size=2G'), ('/run/hybridvm', 'mode=0755'),
                                     ('/run/containers', 'mode=0700')])
            self.assertIn('<h1>hello</h1>', p.stdout)
            self.assertIn('hello from a container\nstopped\n', p.stdout)
            self.assertIn('a container on a hybrid volume', p.stdout)
            self.assertIn(f'"mountpoint": "{self.run_dir}/www/mnt"', p.stdout)
            self.assertIn('"reused": false', p.stdout)     # a new region, bound at mount
            self.assertEqual(self.vols.names(), [])
            for name in ('www', 'db', 'old', 'web', 'containers'):
                self.assertIsNone(self.vols._state(name))
            self.assertFalse([m for m in host.mountinfo() if m['target'].startswith(self.tmp)])
        finally:
            broker.stop()
            subprocess.run(['rm', '-rf', pool])


if __name__ == '__main__':
    unittest.main()
