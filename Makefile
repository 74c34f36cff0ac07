# flowhost: build and install. `make install` builds in release mode, then installs;
# DESTDIR stages the tree (packaging), PREFIX moves the program (default /usr/local).
#
#   make install                      # as root, onto this machine
#   make install DESTDIR=/tmp/stage   # staged, e.g. for a package
#
# After installing on a machine, follow README.md, "Deployment" (users, directories, the
# configuration readable by group flowhost alone, clients in group flowhost-clients, then
# the units).
#
# The example configuration is the pricing lab: its signed manifests and registered public
# keys go next to it in /etc/flowhost, its documents under DATADIR (executors, each running
# as a uid of its own, cannot enter /etc/flowhost). Replace them with your own servers'.

PREFIX      ?= /usr/local
DESTDIR     ?=
BINDIR      ?= $(PREFIX)/bin
LIBEXECDIR  ?= $(PREFIX)/libexec/flowhost
DOCDIR      ?= $(PREFIX)/share/doc/flowhost
DATADIR     ?= $(PREFIX)/share/flowhost
SYSCONFDIR  ?= /etc
UNITDIR     ?= /etc/systemd/system
SYSUSERSDIR ?= /usr/lib/sysusers.d
TMPFILESDIR ?= /usr/lib/tmpfiles.d
BUILD_DIR   ?= target/release
CARGO       ?= cargo

# The example configuration's servers (manifest NAME.signed.json, key keys/NAME.pub).
EXAMPLE_SERVERS = workspace team-inbox public-inbox

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
	install -d $(DESTDIR)$(SYSCONFDIR)/flowhost
	sed -e 's#/usr/local/libexec/flowhost#$(LIBEXECDIR)#g' -e 's#/usr/local/share/flowhost#$(DATADIR)#g' \
		fixtures/pricing-lab/host.toml > $(DESTDIR)$(SYSCONFDIR)/flowhost/flowhost.toml.example
	chmod 0640 $(DESTDIR)$(SYSCONFDIR)/flowhost/flowhost.toml.example
	for s in $(EXAMPLE_SERVERS); do \
		install -Dm0644 fixtures/pricing-lab/$$s.signed.json $(DESTDIR)$(SYSCONFDIR)/flowhost/$$s.signed.json && \
		install -Dm0644 fixtures/pricing-lab/keys/$$s.pub $(DESTDIR)$(SYSCONFDIR)/flowhost/keys/$$s.pub || exit 1; \
	done
	install -Dm0644 fixtures/pricing-lab/documents/harbor-goods-terms.md $(DESTDIR)$(DATADIR)/documents/harbor-goods-terms.md
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
		$(DESTDIR)$(DOCDIR)/README.md $(DESTDIR)$(SYSCONFDIR)/flowhost/flowhost.toml.example \
		$(DESTDIR)$(DATADIR)/documents/harbor-goods-terms.md
	for s in $(EXAMPLE_SERVERS); do \
		rm -f $(DESTDIR)$(SYSCONFDIR)/flowhost/$$s.signed.json $(DESTDIR)$(SYSCONFDIR)/flowhost/keys/$$s.pub; \
	done
