# flowhost: build and install. `make install` builds in release mode, then installs;
# DESTDIR stages the tree (packaging), PREFIX moves the program (default /usr/local).
#
#   make install                      # as root, onto this machine
#   make install DESTDIR=/tmp/stage   # staged, e.g. for a package
#
# After installing on a machine: systemd-sysusers; systemd-tmpfiles --create;
# copy /etc/flowhost/flowhost.toml.example to /etc/flowhost/flowhost.toml and edit it;
# systemctl daemon-reload; systemctl enable --now flowhost.socket flowhost.service.

PREFIX      ?= /usr/local
DESTDIR     ?=
BINDIR      ?= $(PREFIX)/bin
LIBEXECDIR  ?= $(PREFIX)/libexec/flowhost
DOCDIR      ?= $(PREFIX)/share/doc/flowhost
SYSCONFDIR  ?= /etc
UNITDIR     ?= /etc/systemd/system
SYSUSERSDIR ?= /usr/lib/sysusers.d
TMPFILESDIR ?= /usr/lib/tmpfiles.d
BUILD_DIR   ?= target/release
CARGO       ?= cargo

.PHONY: all build install install-files uninstall

all: build

build:
	$(CARGO) build --release --locked -p flowhost -p flowhost-example-tools

install: build install-files

install-files:
	install -Dm0755 $(BUILD_DIR)/flowhost $(DESTDIR)$(BINDIR)/flowhost
	install -Dm0755 $(BUILD_DIR)/flowhost-tool-workspace $(DESTDIR)$(LIBEXECDIR)/flowhost-tool-workspace
	install -Dm0755 $(BUILD_DIR)/flowhost-tool-publisher $(DESTDIR)$(LIBEXECDIR)/flowhost-tool-publisher
	install -Dm0644 profiles/isolated.toml $(DESTDIR)$(SYSCONFDIR)/flowhost/profiles/isolated.toml
	install -Dm0644 profiles/brokered.toml $(DESTDIR)$(SYSCONFDIR)/flowhost/profiles/brokered.toml
	install -Dm0640 fixtures/pricing-lab/host.toml $(DESTDIR)$(SYSCONFDIR)/flowhost/flowhost.toml.example
	install -d $(DESTDIR)$(UNITDIR)
	sed -e 's#/usr/local/bin/flowhost#$(BINDIR)/flowhost#g' -e 's#/usr/local/share/doc/flowhost#$(DOCDIR)#g' \
		systemd/flowhost.service > $(DESTDIR)$(UNITDIR)/flowhost.service
	sed -e 's#/usr/local/share/doc/flowhost#$(DOCDIR)#g' systemd/flowhost.socket > $(DESTDIR)$(UNITDIR)/flowhost.socket
	chmod 0644 $(DESTDIR)$(UNITDIR)/flowhost.service $(DESTDIR)$(UNITDIR)/flowhost.socket
	install -Dm0644 systemd/flowhost.sysusers.conf $(DESTDIR)$(SYSUSERSDIR)/flowhost.conf
	install -Dm0644 systemd/flowhost.tmpfiles.conf $(DESTDIR)$(TMPFILESDIR)/flowhost.conf
	install -Dm0644 README.md $(DESTDIR)$(DOCDIR)/README.md

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/flowhost $(DESTDIR)$(LIBEXECDIR)/flowhost-tool-workspace \
		$(DESTDIR)$(LIBEXECDIR)/flowhost-tool-publisher \
		$(DESTDIR)$(UNITDIR)/flowhost.service $(DESTDIR)$(UNITDIR)/flowhost.socket \
		$(DESTDIR)$(SYSUSERSDIR)/flowhost.conf $(DESTDIR)$(TMPFILESDIR)/flowhost.conf \
		$(DESTDIR)$(DOCDIR)/README.md $(DESTDIR)$(SYSCONFDIR)/flowhost/flowhost.toml.example
