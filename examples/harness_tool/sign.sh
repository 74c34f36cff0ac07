#!/usr/bin/env bash
# Signs the status probe's manifest with its key (Ed25519 signatures are deterministic: the
# output matches the committed envelope unless manifest.json changed). A tool author signs
# with their own key, made once with `flowhost key generate --out keys --name NAME`.
#
# Usage: examples/harness_tool/sign.sh     ($FLOWHOST: the flowhost binary, default on PATH)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
flowhost="${FLOWHOST:-flowhost}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# git checks key files out 0644, and flowhost refuses a private key others may read.
install -m 600 "$here/keys/status-probe.key" "$tmp/status-probe.key"
"$flowhost" manifest sign --key "$tmp/status-probe.key" --manifest "$here/manifest.json" \
  --out "$here/manifest.signed.json"
