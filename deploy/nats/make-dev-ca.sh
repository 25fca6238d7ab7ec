#!/usr/bin/env bash
# A throwaway certificate authority for TLS on the bus in development and tests.
#
#   deploy/nats/make-dev-ca.sh OUT_DIR [EXTRA_DNS_NAME...]
#
# Writes OUT_DIR/{ca,server,client}.{crt,key}: a CA, a server certificate for
# localhost / 127.0.0.1 / the in-cluster names of the NATS service (plus any extra
# names given), and a client certificate for mutual TLS (tls-mtls.conf). Keys are
# ECDSA P-256, valid 30 days. Never use these in production: issue certificates
# from your real CA (cert-manager in Kubernetes) instead.
set -euo pipefail

out=${1:?usage: make-dev-ca.sh OUT_DIR [EXTRA_DNS_NAME...]}
shift
mkdir -p "$out"
cd "$out"
umask 077

san="DNS:localhost,IP:127.0.0.1,DNS:nats,DNS:nats.tensorbus,DNS:nats.tensorbus.svc"
san="$san,DNS:nats.tensorbus.svc.cluster.local,DNS:*.nats-headless.tensorbus.svc.cluster.local"
for name in "$@"; do san="$san,DNS:$name"; done

key() { openssl ecparam -name prime256v1 -genkey -noout -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -sha256 -days 30 -subj "/CN=tensorbus dev CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out ca.crt

issue() {  # issue NAME CN EXTENDED_USAGE [SAN]
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$3"
    if [ -n "${4:-}" ]; then echo "subjectAltName=$4"; fi
  } > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days 30 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

issue server "nats" serverAuth "$san"
issue client "tensorbus-client" clientAuth
chmod 644 ca.crt server.crt client.crt
echo "wrote $(pwd)/{ca,server,client}.{crt,key}"
