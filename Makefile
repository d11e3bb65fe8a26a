# Conventional verbs over the meson build in build/. Every verb installs what it needs first.
BUILD ?= build
MESON := $(BUILD)/venv/bin/meson

.PHONY: all setup guest demo demo-libvirt check check-long bench install clean distclean

all: setup
	@test -f $(BUILD)/build.ninja || $(MESON) setup $(BUILD) . >/dev/null
	ninja -C $(BUILD)

setup:
	@./scripts/setup-host.sh

guest: all
	@./scripts/build-guest.sh

demo: guest
	@$(BUILD)/venv/bin/python3 scripts/demo.py $(DEMO_ARGS)

demo-libvirt: guest
	@$(BUILD)/venv/bin/python3 scripts/demo.py --libvirt $(DEMO_ARGS)

check: guest
	@./scripts/check.sh

check-long: guest
	@./scripts/check.sh --long

bench: guest
	@./scripts/bench.sh

# make install: the tree the Debian packages hold (make deb builds them from
# it, PREFIX=/usr), for hosts that are not Debian.  Programs and libraries go
# under PREFIX (default /usr/local); configuration, state and sockets have one
# place whatever PREFIX is (/etc/hybridvm, /var/lib, /run: the units, the
# docs and the examples name them).  A configuration file that exists is
# left alone.  The tree must be built first (make).  docs/deploy.md.
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
BINDIR = $(PREFIX)/bin
LIB_DIR = $(PREFIX)/lib/hybridvm/python
MAN_DIR = $(PREFIX)/share/man
EXAMPLES_DIR = $(PREFIX)/share/hybridvm/examples
REDIS_MODULE_DIR ?= $(PREFIX)/lib/redis/modules
UNIT_DIR ?= $(PREFIX)/lib/systemd/system
CONF_DIR = $(DESTDIR)$(SYSCONFDIR)/hybridvm
# podman's drop-in naming hvvol's volume plugin (driver hybridvm)
PODMAN_CONF = $(DESTDIR)$(SYSCONFDIR)/containers/containers.conf.d/50-hybridvm-volume.conf
QEMU_PROGRAMS = qemu-system-x86_64 qemu-img qemu-io qemu-nbd qemu-storage-daemon
MAN_PAGES = hvmemd.8 hvmem.1 hvarbiter.8 hvcache.8 hvvol.8
# The libvirt hook, in libvirt's qemu.d/ layout (libvirt >= 6.5 runs every
# executable there), its configuration (/etc/hybridvm/libvirt-hook.conf)
# unless one exists, and the example domains.  Our host library
# (python/hvqmp.py) goes to $(LIB_DIR), and the hook's marked line is
# rewritten to look there.  install-hook installs only these.
HOOKS_DIR ?= $(DESTDIR)$(SYSCONFDIR)/libvirt/hooks
HOOK_LIB_LINE = LIB_DIR = '$(LIB_DIR)'  \# make install
BUILT = $(addprefix $(BUILD)/bin/,$(QEMU_PROGRAMS)) $(BUILD)/broker/hvmemd $(BUILD)/broker/hvmem \
	$(BUILD)/redis-module/hybridmem.so

.PHONY: install-hook install-built deb
install: install-hook install-built
	@echo "installed; restart libvirtd so that it notices new hooks"

install-hook:
	install -D -m 0644 python/hvqmp.py $(DESTDIR)$(LIB_DIR)/hvqmp.py
	install -d $(HOOKS_DIR)/qemu.d
	sed "s|^LIB_DIR = .*  # make install\$$|$(HOOK_LIB_LINE)|" libvirt-hooks/qemu \
		>$(HOOKS_DIR)/.50-hybridvm.tmp
	grep -qxF "$(HOOK_LIB_LINE)" $(HOOKS_DIR)/.50-hybridvm.tmp || \
		{ rm -f $(HOOKS_DIR)/.50-hybridvm.tmp; \
		  echo "install: the hook's LIB_DIR line was not rewritten" >&2; exit 1; }
	chmod 0755 $(HOOKS_DIR)/.50-hybridvm.tmp
	mv -f $(HOOKS_DIR)/.50-hybridvm.tmp $(HOOKS_DIR)/qemu.d/50-hybridvm
	test -e $(CONF_DIR)/libvirt-hook.conf || \
		install -D -m 0644 libvirt-hooks/hybridvm.conf.example $(CONF_DIR)/libvirt-hook.conf
	install -d $(DESTDIR)$(EXAMPLES_DIR)
	install -m 0644 libvirt-hooks/examples/*.xml $(DESTDIR)$(EXAMPLES_DIR)/

# QEMU, the broker, the Redis module (where Debian's redis-server packages
# keep theirs), the arbiter, hvvol and hvcache (Python, beside hvqmp), the
# units (ExecStart= names BINDIR), the AppArmor abstraction for the guests'
# QEMU (libvirt-hooks/apparmor), configuration examples (and podman's
# drop-in for hvvol's plugin), man pages.
install-built:
	@for f in $(BUILT); do test -e $$f || \
		{ echo "install: $$f is missing: build first (make)" >&2; exit 1; }; done
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIB_DIR)/arbiter $(DESTDIR)$(LIB_DIR)/volume \
		$(DESTDIR)$(REDIS_MODULE_DIR) $(DESTDIR)$(SYSCONFDIR)/containers/containers.conf.d \
		$(DESTDIR)$(UNIT_DIR) $(CONF_DIR)/clone-cache \
		$(DESTDIR)$(MAN_DIR)/man1 $(DESTDIR)$(MAN_DIR)/man8
	install -m 0755 $(addprefix $(BUILD)/bin/,$(QEMU_PROGRAMS)) \
		$(BUILD)/broker/hvmemd $(BUILD)/broker/hvmem $(DESTDIR)$(BINDIR)/
	install -m 0755 $(BUILD)/redis-module/hybridmem.so $(DESTDIR)$(REDIS_MODULE_DIR)/
	install -m 0644 $$(ls arbiter/*.py) $(DESTDIR)$(LIB_DIR)/arbiter/
	install -m 0644 python/hvfiles.py $(DESTDIR)$(LIB_DIR)/hvfiles.py
	install -m 0755 arbiter/hvarbiter $(DESTDIR)$(LIB_DIR)/arbiter/hvarbiter
	ln -sfn $(LIB_DIR)/arbiter/hvarbiter $(DESTDIR)$(BINDIR)/hvarbiter
	install -m 0755 clone-cache/hvcache $(DESTDIR)$(BINDIR)/hvcache
	install -m 0644 $$(ls volume/*.py) $(DESTDIR)$(LIB_DIR)/volume/
	install -m 0755 volume/hvvol $(DESTDIR)$(LIB_DIR)/volume/hvvol
	ln -sfn $(LIB_DIR)/volume/hvvol $(DESTDIR)$(BINDIR)/hvvol
	install -D -m 0644 libvirt-hooks/apparmor/hybridvm-qemu \
		$(DESTDIR)$(SYSCONFDIR)/apparmor.d/abstractions/hybridvm-qemu
	for u in hvmemd.service hvarbiter.service hvcache@.service hvvol-plugin.service; do \
		sed 's|@BINDIR@|$(BINDIR)|g' packaging/$$u.in >$(DESTDIR)$(UNIT_DIR)/.$$u.tmp && \
		chmod 0644 $(DESTDIR)$(UNIT_DIR)/.$$u.tmp && \
		mv -f $(DESTDIR)$(UNIT_DIR)/.$$u.tmp $(DESTDIR)$(UNIT_DIR)/$$u || exit 1; done
	set -e; for c in broker/broker.conf.example:broker.conf arbiter/arbiter.conf.example:arbiter.conf \
		clone-cache/gold.conf.example:clone-cache/gold.conf; do \
		test -e $(CONF_DIR)/$${c#*:} || install -m 0644 $${c%%:*} $(CONF_DIR)/$${c#*:}; done
	test -e $(PODMAN_CONF) || install -m 0644 volume/containers.conf.example $(PODMAN_CONF)
	set -e; for m in $(MAN_PAGES); do \
		rst2man --halt=warning docs/man/$$m.rst | gzip -9n >$(DESTDIR)$(MAN_DIR)/man$${m##*.}/$$m.gz; \
		chmod 0644 $(DESTDIR)$(MAN_DIR)/man$${m##*.}/$$m.gz; done

# Debian packages from the built tree (scripts/build-debs.sh; docs/deploy.md).
deb: all
	@./scripts/build-debs.sh

clean:
	rm -rf $(BUILD)/qemu-build $(BUILD)/guest $(BUILD)/meson-* $(BUILD)/build.ninja

distclean:
	rm -rf $(BUILD)
