#!/usr/bin/env bash
# A private CA and a server certificate signed by it, for the compose profile `tls`
# (docs/deployment.md, "TLS"): for a test, a machine of your own, or an internal network
# whose clients you can give the CA. A public name should get its certificate from a
# public CA (ACME) instead; the proxy takes any PEM certificate chain and key.
#
#   bash scripts/tls-cert.sh DIR [NAME...]      # NAMEs: DNS names or IP addresses
#   bash scripts/tls-cert.sh secrets/tls localhost 127.0.0.1     # the defaults
#
# Writes DIR/ca.crt (give it to clients: curl --cacert, httpx verify=), DIR/ca.key (keep
# it offline; it signs anything), DIR/server.crt and DIR/server.key (the proxy's:
# TLS_CERT_FILE and TLS_KEY_FILE). Keys are 0600 and never printed. Existing files are
# never overwritten. Certificates are valid for DAYS days (env, default 825).
set -euo pipefail
dir=${1:?usage: $0 DIR [NAME...]}
shift
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=(localhost 127.0.0.1)
days=${DAYS:-825}
san=""
for name in "${names[@]}"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="${san:+,}IP:$name"; else san+="${san:+,}DNS:$name"; fi
done
mkdir -p "$dir"
for file in ca.crt ca.key server.crt server.key; do
  if [ -e "$dir/$file" ]; then echo "$0: $dir/$file exists; not overwriting" >&2; exit 1; fi
done
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" -subj "/CN=WorldCup private CA" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2> /dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$dir/server.key" -out "$dir/server.csr" -subj "/CN=${names[0]}" 2> /dev/null
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -CAcreateserial -CAserial "$dir/ca.srl" -days "$days" -out "$dir/server.crt" \
  -extfile <(printf '%s\n' "subjectAltName=$san" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" \
    "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid") 2> /dev/null
rm -f "$dir/server.csr" "$dir/ca.srl"
chmod 0644 "$dir/ca.crt" "$dir/server.crt"
echo "$dir: ca.crt (for clients), ca.key (keep offline), server.crt + server.key for $san"
