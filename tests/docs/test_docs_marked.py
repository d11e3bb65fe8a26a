"""Every shell block of the user docs runs in a test, or says why not
(issue 38, item 6).  Fast, no root, nothing started.

The user docs are README.md, docs/*.md and docs/*.rst.  Not checked:
- docs/man/*.rst, the man pages: reference pages (rst2man makes them,
  `make install`); their literal blocks show what a packaged unit runs or
  the shape of a command, and the user guide each page points to holds the
  runnable form (docs/broker.md for hvmemd(8), docs/clone-cache.md for
  hvcache(8)...);
- docs/bench/*.md: the benchmarks' results, written by bench/*.py, whose
  blocks are the programs' output.

In them (tests/hvlib/docblocks.py parses both formats):
- every fenced Markdown block names its language (```sh, ```text, ...);
- reStructuredText shell blocks are `.. code-block:: sh`: a bare `::`
  literal block whose first word is a command (COMMANDS) fails, since it
  could be neither run nor marked;
- every shell block (sh, bash, console...) is either marked not run with a
  reason (`<!-- not run: REASON -->` / `.. not run: REASON` right before
  it), or is `sh` in a doc REGISTRY names with the test that runs it; that
  test file exists, names the doc and runs it through docblocks (so the
  blocks it runs are the ones this test sees)."""
import glob
import os
import shutil
import sys
import tempfile
import unittest

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(TOP, 'tests'))
from hvlib import docblocks     # noqa: E402

# doc -> the test file that runs its sh blocks as written
REGISTRY = {
    'docs/broker.md': 'tests/docs/test_docs_host.py',
    'docs/ceph.md': 'tests/docs/test_docs_ceph.py',
    'docs/clone-cache.md': 'tests/docs/test_docs_ceph.py',
    'docs/containers.md': 'volume/tests/test_doc.py',
    'docs/deploy.md': 'tests/packaging/test_deploy.py',
    'docs/hybrid.md': 'tests/docs/test_docs_host.py',
}
SHELL_LANGS = ('sh', 'bash', 'shell', 'console', 'shell-session', 'zsh')
COMMANDS = frozenset('''
    virsh make hvmem hvmemd hvvol hvcache hvarbiter qemu-img qemu-io qemu-nbd
    qemu-storage-daemon qemu-system-x86_64 rbd ceph podman redis-cli redis-server
    apt-get systemctl mkdir ninja'''.split())
COMMAND_PREFIXES = ('scripts/', './scripts/', 'build/')


def user_docs():
    """The docs checked, relative to the top of the tree."""
    return ['README.md'] + sorted(
        os.path.relpath(p, TOP) for pattern in ('docs/*.md', 'docs/*.rst')
        for p in glob.glob(os.path.join(TOP, pattern)))


def first_command(body):
    """The first word of a block, past a prompt, `sudo` and variable
    assignments ('' for a block with none)."""
    for word in body.split():
        if word not in ('$', '#', 'sudo') and '=' not in word:
            return word
    return ''


def is_command(word):
    return word in COMMANDS or word.startswith(COMMAND_PREFIXES)


def problems(doc):
    """What is wrong with the doc's blocks, one line each (doc:line: what)."""
    out = []
    for b in docblocks.blocks(os.path.join(TOP, doc)):
        where = f'{doc}:{b.line}'
        if doc.endswith('.md') and not b.lang:
            out.append(f'{where}: a fenced block without a language (```sh, ```text...)')
        elif doc.endswith('.rst') and not b.lang and is_command(first_command(b.body)):
            out.append(f'{where}: commands in a bare :: block: make it `.. code-block:: sh`')
        if b.lang not in SHELL_LANGS:
            continue
        if b.not_run_reason is not None:
            if len(b.not_run_reason) < 20:
                out.append(f'{where}: not run because {b.not_run_reason!r}: a reason, not a word')
        elif b.lang not in docblocks.RUNNABLE:
            out.append(f'{where}: a {b.lang} block is not run: make it sh, or mark it '
                       'not run with the reason')
        elif doc not in REGISTRY:
            out.append(f'{where}: an sh block no test runs: run the doc in a test (and '
                       'add it to REGISTRY), or mark the block not run with the reason')
    return out


class DocsMarked(unittest.TestCase):

    def test_blocks_run_or_say_why(self):
        docs = user_docs()
        self.assertIn('docs/hybrid.md', docs)
        for doc in docs:
            with self.subTest(doc=doc):
                found = problems(doc)
                if found:
                    self.fail('\n' + '\n'.join(found))

    def test_registered_tests_run_their_docs(self):
        """Each registered doc has blocks to run, and its test file exists,
        names the doc and uses docblocks."""
        for doc, test in REGISTRY.items():
            with self.subTest(doc=doc):
                self.assertTrue(docblocks.runnable(os.path.join(TOP, doc)),
                                f'{doc} has no sh block to run: take it out of REGISTRY')
                path = os.path.join(TOP, test)
                self.assertTrue(os.path.isfile(path), f'{test}, which runs {doc}, is missing')
                with open(path) as f:
                    text = f.read()
                self.assertIn(doc, text, f'{test} does not name {doc}')
                self.assertIn('docblocks', text, f'{test} does not run {doc} through '
                              'tests/hvlib/docblocks.py')


class Parser(unittest.TestCase):
    """docblocks finds the blocks and markers this test relies on, and
    problems() names what is wrong."""

    def doc(self, name, text):
        tmp = tempfile.mkdtemp(prefix='docs-marked-')
        self.addCleanup(shutil.rmtree, tmp)
        path = os.path.join(tmp, name)
        with open(path, 'w') as f:
            f.write(text)
        return path

    def test_markdown(self):
        path = self.doc('a.md', 'Text\n\n```sh\necho a\n```\n'
                        '<!-- not run: it needs\n  a libvirt host -->\n```sh\nvirsh list\n```\n'
                        '- item\n\n  ```text\n    indented\n  ```\n```\nbare\n```\n')
        self.assertEqual(docblocks.blocks(path), [
            docblocks.Block('sh', 'echo a\n', 3, None),
            docblocks.Block('sh', 'virsh list\n', 8, 'it needs a libvirt host'),
            docblocks.Block('text', '  indented\n', 13, None),
            docblocks.Block('', 'bare\n', 16, None)])
        self.assertEqual(problems(path), [
            f'{path}:3: an sh block no test runs: run the doc in a test (and add it to '
            'REGISTRY), or mark the block not run with the reason',
            f'{path}:16: a fenced block without a language (```sh, ```text...)'])

    def test_rst(self):
        path = self.doc('a.rst', 'Run::\n\n   make install-hook\n\n'
                        '.. not run: it needs\n   a libvirt host\n\n'
                        '.. code-block:: sh\n\n   virsh list\n   virsh start vm1\n\n'
                        'Then::\n\n   [section]\n\n.. code-block:: console\n\n   $ ls\n\nEnd.\n')
        self.assertEqual(docblocks.blocks(path), [
            docblocks.Block('', 'make install-hook\n', 1, None),
            docblocks.Block('sh', 'virsh list\nvirsh start vm1\n', 8, 'it needs a libvirt host'),
            docblocks.Block('', '[section]\n', 13, None),
            docblocks.Block('console', '$ ls\n', 17, None)])
        self.assertEqual(problems(path), [
            f'{path}:1: commands in a bare :: block: make it `.. code-block:: sh`',
            f'{path}:17: a console block is not run: make it sh, or mark it not run '
            'with the reason'])


if __name__ == '__main__':
    unittest.main()
