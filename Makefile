# Conventional verbs over the meson build in build/. Every verb installs what it needs first.
BUILD ?= build
MESON := $(BUILD)/venv/bin/meson

.PHONY: all setup guest demo check check-long bench clean distclean

all: setup
	@test -f $(BUILD)/build.ninja || $(MESON) setup $(BUILD) . >/dev/null
	ninja -C $(BUILD)

setup:
	@./scripts/setup-host.sh

guest: all
	@./scripts/build-guest.sh

demo: guest
	@$(BUILD)/venv/bin/python3 scripts/demo.py

check: guest
	@./scripts/check.sh

check-long: guest
	@./scripts/check.sh --long

bench: guest
	@./scripts/bench.sh

clean:
	rm -rf $(BUILD)/qemu-build $(BUILD)/guest $(BUILD)/meson-* $(BUILD)/build.ninja

distclean:
	rm -rf $(BUILD)
