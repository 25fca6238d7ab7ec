#!/usr/bin/env bash
# One random password per tensorbus role, as an env file.
#
#   deploy/nats/make-passwords.sh > secrets/nats-passwords.env   (keep it out of git)
#   set -a; . secrets/nats-passwords.env; set +a; nats-server -c deploy/nats/auth.conf
#
# `tb` + 48 hex digits: starts with a letter and holds only [a-z0-9], so the
# nats-server config parser reads it as a string, and it needs no escaping inside
# a URL (TENSORBUS_NATS_URL=nats://worker:PASSWORD@host:4222).
set -euo pipefail
for role in gateway scheduler worker telemetry batch deploy client; do
  printf 'TENSORBUS_NATS_PASS_%s=tb%s\n' "${role^^}" "$(openssl rand -hex 24)"
done
