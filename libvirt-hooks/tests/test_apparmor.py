"""The AppArmor snippet for libvirt's QEMU (libvirt-hooks/apparmor/hybridvm-qemu)
compiles as a domain's profile would take it: through libvirt's own
<abstractions/libvirt-qemu> and its local include.  This host's kernel has
no AppArmor, so the profile is compiled (apparmor_parser -QTK: no kernel
load, no cache) and never loaded or enforced."""
import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SNIPPET = os.path.join(os.path.dirname(HERE), 'apparmor', 'hybridvm-qemu')
PARSER = shutil.which('apparmor_parser', path=os.environ.get('PATH', '') + ':/usr/sbin:/sbin')
LIBVIRT_ABSTRACTION = '/etc/apparmor.d/abstractions/libvirt-qemu'

# libvirt's template for a domain's profile (/etc/apparmor.d/libvirt/TEMPLATE.qemu).
PROFILE = """#include <tunables/global>
profile libvirt-00000000-0000-0000-0000-000000000000 flags=(attach_disconnected) {
  #include <abstractions/libvirt-qemu>
}
"""


@unittest.skipUnless(PARSER, 'apparmor_parser is not installed (apt-get install apparmor)')
class AppArmorSnippetTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='hv-apparmor-')
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        os.makedirs(os.path.join(self.dir, 'abstractions'))
        os.makedirs(os.path.join(self.dir, 'local', 'abstractions'))
        shutil.copy(SNIPPET, os.path.join(self.dir, 'abstractions', 'hybridvm-qemu'))
        self.profile = os.path.join(self.dir, 'libvirt-test')

    def parse(self, *args):
        """apparmor_parser on the profile, our directory searched before the
        system's; returns (returncode, output)."""
        r = subprocess.run([PARSER, '-QTK', '-I', self.dir, '-I', '/etc/apparmor.d', *args,
                            self.profile], capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout + r.stderr

    def local_include(self):
        """The line an administrator (or the package) adds to
        /etc/apparmor.d/local/abstractions/libvirt-qemu, in our copy of it."""
        with open(os.path.join(self.dir, 'local', 'abstractions', 'libvirt-qemu'), 'w') as f:
            f.write('include <abstractions/hybridvm-qemu>\n')

    def test_compiles_through_libvirts_abstraction(self):
        if not os.path.exists(LIBVIRT_ABSTRACTION):
            self.skipTest(f'{LIBVIRT_ABSTRACTION} is not installed (libvirt-daemon-system)')
        with open(LIBVIRT_ABSTRACTION) as f:
            if 'local/abstractions/libvirt-qemu' not in f.read():
                self.skipTest(f'{LIBVIRT_ABSTRACTION} has no local include')
        self.local_include()
        with open(self.profile, 'w') as f:
            f.write(PROFILE)
        code, out = self.parse()
        self.assertEqual(code, 0, out)
        # and the rules are in the profile libvirt's QEMU would run under
        code, out = self.parse('-p')
        self.assertEqual(code, 0, out)
        self.assertIn('/var/lib/hybridvm/images/** rwk,', out)
        self.assertIn('/{dev,run}/shm/hybridvm-broker/r-[0-9]* rwm,', out)

    def test_compiles_alone(self):
        """In a profile of its own (what a host without libvirt's abstraction
        can still check)."""
        with open(self.profile, 'w') as f:
            f.write('profile hybridvm-test {\n  #include <abstractions/hybridvm-qemu>\n}\n')
        code, out = self.parse()
        self.assertEqual(code, 0, out)

    def test_a_broken_rule_is_caught(self):
        """The parser is a real check: a bad permission in the snippet fails."""
        with open(os.path.join(self.dir, 'abstractions', 'hybridvm-qemu'), 'a') as f:
            f.write('  /var/lib/hybridvm/images/** rwz,\n')
        with open(self.profile, 'w') as f:
            f.write('profile hybridvm-test {\n  #include <abstractions/hybridvm-qemu>\n}\n')
        code, out = self.parse()
        self.assertNotEqual(code, 0, out)


if __name__ == '__main__':
    unittest.main()
