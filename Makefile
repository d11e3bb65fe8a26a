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

# The libvirt hook, in libvirt's qemu.d/ layout (libvirt >= 6.5 runs every
# executable there), and its configuration unless one exists.  Our host
# library (python/hvqmp.py) goes to $(LIB_DIR), and the hook's marked line
# is rewritten to look there.
HOOKS_DIR ?= $(DESTDIR)/etc/libvirt/hooks
PREFIX ?= /usr/local
LIB_DIR = $(PREFIX)/lib/hybridvm/python
HOOK_LIB_LINE = LIB_DIR = '$(LIB_DIR)'  \# make install
install:
	install -D -m 0644 python/hvqmp.py $(DESTDIR)$(LIB_DIR)/hvqmp.py
	install -d $(HOOKS_DIR)/qemu.d
	sed "s|^LIB_DIR = .*  # make install\$$|$(HOOK_LIB_LINE)|" libvirt-hooks/qemu \
		>$(HOOKS_DIR)/.50-hybridvm.tmp
	grep -qxF "$(HOOK_LIB_LINE)" $(HOOKS_DIR)/.50-hybridvm.tmp || \
		{ rm -f $(HOOKS_DIR)/.50-hybridvm.tmp; \
		  echo "install: the hook's LIB_DIR line was not rewritten" >&2; exit 1; }
	chmod 0755 $(HOOKS_DIR)/.50-hybridvm.tmp
	mv -f $(HOOKS_DIR)/.50-hybridvm.tmp $(HOOKS_DIR)/qemu.d/50-hybridvm
	test -e $(HOOKS_DIR)/hybridvm.conf || \
		install -m 0644 libvirt-hooks/hybridvm.conf.example $(HOOKS_DIR)/hybridvm.conf
	@echo "installed; restart libvirtd so that it notices new hooks"

clean:
	rm -rf $(BUILD)/qemu-build $(BUILD)/guest $(BUILD)/meson-* $(BUILD)/build.ninja

distclean:
	rm -rf $(BUILD)
