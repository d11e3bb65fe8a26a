"""The code blocks of the user documentation, so tests can run them as written.

A doc's shell blocks are commands a reader may paste; a test runs them in
document order as one `sh -eu` script, so a doc that drifts from the
programs fails a test instead of a reader.  A block that cannot run in a
test (it needs a libvirt host, a registry, root on a real machine...) says
so, with the reason, right before it:

  Markdown:          <!-- not run: REASON -->      (the line before the fence)
  reStructuredText:  .. not run: REASON            (the comment right before
                                                    the `.. code-block::`)

Markdown blocks are fenced (```LANG); reStructuredText ones are
`.. code-block:: LANG` directives and `::` literal blocks (no language:
only code-block blocks can be shell blocks to run).

    for b in blocks('docs/hybrid.md'): ...      # Block(lang, body, line, not_run_reason)
    script('docs/hybrid.md')                    # its runnable blocks as one sh text
    run('docs/hybrid.md', env=env, cwd=tmp)     # runs them; BlockFailed names the block
    run('docs/ceph.md', only=lambda b: ..., tmpfs=['/run/hybridvm'])
"""
import os
import re
import shlex
import signal
import subprocess
import tempfile
from typing import NamedTuple, Optional

# The blocks a test runs: shell code a reader pastes into sh.
RUNNABLE = ('sh',)


class Block(NamedTuple):
    lang: str                       # '' for an rst `::` block or a bare fence
    body: str                       # the text, dedented, ending in a newline
    line: int                       # 1-based line of the fence / directive / `::`
    not_run_reason: Optional[str]   # None: the block is meant to run


class BlockFailed(AssertionError):
    """A doc's script failed: the message names the block (doc:line), shows
    it, the exit status and the output.  An AssertionError, so a unittest
    reports a failure, not an error."""


def blocks(path):
    """The code blocks of a Markdown (.md) or reStructuredText (.rst) file,
    in document order."""
    with open(path) as f:
        lines = f.read().split('\n')
    return _rst_blocks(lines) if path.endswith('.rst') else _md_blocks(lines)


def runnable(path, only=None):
    """The blocks of `path` a test runs: RUNNABLE, not marked not run, and
    (if given) accepted by only(block)."""
    return [b for b in blocks(path)
            if b.lang in RUNNABLE and b.not_run_reason is None and (only is None or only(b))]


def script(path, only=None):
    """The runnable blocks of `path` as one sh script, each after a comment
    naming where it is in the doc."""
    return ''.join(f'# {path}:{b.line}\n{b.body}' for b in runnable(path, only))


def run(path, env=None, cwd=None, timeout=600, only=None, tmpfs=()):
    """Run the doc's script with `sh -eu` in cwd with env (default: this
    process's).  tmpfs: directories the doc names (/run/..., /srv) to cover
    with a fresh tmpfs in a mount namespace of the script's own, so it runs
    as written without touching the host's (needs root); each a path
    (mode 0755) or (path, mount options).  The script runs
    in a session of its own that is killed as soon as the script ends, so a
    daemon a failed script left behind does not outlive it (its output goes
    to files, not pipes such a daemon could hold open).  Returns the
    CompletedProcess (text stdout and stderr); raises BlockFailed naming the
    block that failed or was running at the timeout."""
    found = runnable(path, only)
    if not found:
        raise BlockFailed(f'{path}: no block to run')
    with tempfile.TemporaryDirectory(prefix='docblocks-') as tmp:
        # Before each block the script appends its line to a file of ours:
        # after a failure, the last line there is the block's.
        mark = os.path.join(tmp, 'mark')
        sh = os.path.join(tmp, 'doc.sh')
        with open(sh, 'w') as f:
            f.write(''.join(f'echo {b.line} >>{shlex.quote(mark)}\n# {path}:{b.line}\n{b.body}'
                            for b in found))
        cmd = ['sh', '-eu', sh]
        if tmpfs:
            mounts = [t if isinstance(t, tuple) else (t, 'mode=0755') for t in tmpfs]
            cmd = ['unshare', '-m', '--propagation', 'private', 'sh', '-euc',
                   'while [ $# -gt 0 ]; do mkdir -p "$1"; mount -t tmpfs -o "$2" tmpfs "$1"; '
                   f'shift 2; done; exec sh -eu {shlex.quote(sh)}', 'sh',
                   *[x for m in mounts for x in m]]
        outs = [open(os.path.join(tmp, name), 'w+') for name in ('out', 'err')]
        with outs[0], outs[1]:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=outs[0], stderr=outs[1], start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for f in outs:
                f.seek(0)
            out, err = outs[0].read(), outs[1].read()
        started = []
        if os.path.exists(mark):
            with open(mark) as f:
                started = f.read().split()
    if timed_out or proc.returncode != 0:
        at = int(started[-1]) if started else None
        block = next((b for b in found if b.line == at), None)
        what = (f'timed out after {timeout} s' if timed_out
                else f'exit status {proc.returncode}')
        where = (f'the block at {path}:{at}:\n{block.body}' if block
                 else f'the set-up before the first block of {path} (tmpfs {list(tmpfs)})\n')
        raise BlockFailed(f'{what} in {where}--- stdout:\n{out[-4000:]}--- stderr:\n{err[-4000:]}')
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Markdown ----------------------------------------------------------------

FENCE_RE = re.compile(r'^(\s*)(`{3,}|~{3,})\s*([^\s`]*)')
MD_NOT_RUN_RE = re.compile(r'<!--\s*not run:\s*(.*?)\s*-->\s*\Z', re.DOTALL)


def _md_blocks(lines):
    out = []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf'^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$',
                                              lines[i]):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        i += 1
        out.append(Block(lang, ''.join(text + '\n' for text in body), start + 1,
                         _md_reason(lines, start)))
    return out


def _md_reason(lines, fence):
    """The reason of a `<!-- not run: ... -->` comment that ends on the line
    right before the fence (it may start on an earlier line)."""
    end = fence - 1
    if end < 0 or not lines[end].rstrip().endswith('-->'):
        return None
    start = end
    while start > 0 and '<!--' not in lines[start]:
        start -= 1
    comment = '\n'.join(lines[start:end + 1])
    comment = comment[comment.rfind('<!--'):]
    m = MD_NOT_RUN_RE.match(comment)
    return ' '.join(m.group(1).split()) if m else None


# reStructuredText --------------------------------------------------------

CODE_RE = re.compile(r'^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$')
DIRECTIVE_RE = re.compile(r'^\s*\.\. ')
RST_NOT_RUN_RE = re.compile(r'^(\s*)\.\. not run:\s*(.*)$')


def _indent(line):
    return len(line) - len(line.lstrip())


def _rst_body(lines, i, indent):
    """The block indented more than `indent` from line i on (after the
    directive's options and the blank line): (dedented text, next line)."""
    while i < len(lines) and lines[i].strip() and _indent(lines[i]) > indent:
        i += 1                                  # directive options (:linenos: ...)
    body = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    while body and not body[0].strip():
        body.pop(0)
    cut = min((_indent(text) for text in body if text.strip()), default=0)
    return ''.join(text[cut:] + '\n' for text in body), i


def _rst_reason(lines, at):
    """The reason of a `.. not run: ...` comment right before line `at`
    (blank lines between allowed; the comment may go on in indented lines)."""
    j = at - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    end = j
    while j >= 0 and lines[j].strip():
        m = RST_NOT_RUN_RE.match(lines[j])
        if m:
            rest = lines[j + 1:end + 1]
            if all(_indent(text) > len(m.group(1)) for text in rest):
                return ' '.join(' '.join([m.group(2)] + rest).split())
            return None
        j -= 1
    return None


def _rst_blocks(lines):
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = CODE_RE.match(line)
        if m:
            body, nxt = _rst_body(lines, i + 1, len(m.group(1)))
            out.append(Block(m.group(2), body, i + 1, _rst_reason(lines, i)))
            i = nxt
        elif line.rstrip().endswith('::') and not DIRECTIVE_RE.match(line):
            body, nxt = _rst_body(lines, i + 1, _indent(line))
            if body:
                out.append(Block('', body, i + 1, None))
            i = nxt
        else:
            i += 1
    return out
