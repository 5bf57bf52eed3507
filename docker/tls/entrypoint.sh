#!/bin/sh
# The TLS proxy's entrypoint: writes /etc/nginx/nginx.conf from the template with
#   WORLDCUP_MAX_BODY_BYTES        the app's body limit (default: the app's, 1208192)
#   WORLDCUP_MAX_BATCH_BODY_BYTES  the same on paths ending in /batch (default 16777216)
#   WORLDCUP_TLS_UPSTREAM          the app, host:port on the compose network (app:8000)
#   WORLDCUP_TLS_HSTS              a Strict-Transport-Security value; unset: no header
# and the first nameserver of /etc/resolv.conf (the compose network's DNS), then runs
# the command (nginx in the foreground).
set -eu
max=${WORLDCUP_MAX_BODY_BYTES:-1208192}
batch=${WORLDCUP_MAX_BATCH_BODY_BYTES:-16777216}
upstream=${WORLDCUP_TLS_UPSTREAM:-app:8000}
hsts=${WORLDCUP_TLS_HSTS:-}
fail() { echo "worldcup-tls: $*" >&2; exit 2; }
for value in "$max" "$batch"; do
  case $value in '' | *[!0-9]*) fail "body limits are whole numbers of bytes, not '$value'" ;; esac
done
case $upstream in '' | *[!A-Za-z0-9.:_-]*) fail "WORLDCUP_TLS_UPSTREAM is host:port, not '$upstream'" ;; esac
if [ -n "$hsts" ]; then
  case $hsts in *[!A-Za-z0-9=\;\ -]*) fail "WORLDCUP_TLS_HSTS: a header value like 'max-age=31536000', not '$hsts'" ;; esac
  hsts="add_header Strict-Transport-Security \"$hsts\" always;"
fi
resolver=$(sed -n 's/^nameserver[[:space:]]*\([^[:space:]]*\).*/\1/p' /etc/resolv.conf | head -n 1)
case $resolver in
  '') fail "no nameserver in /etc/resolv.conf" ;;
  *:*) resolver="[$resolver]" ;;
esac
for file in /run/secrets/tls_cert /run/secrets/tls_key; do
  [ -r "$file" ] || fail "$file is missing: the compose secrets tls_cert and tls_key (TLS_CERT_FILE, TLS_KEY_FILE)"
done
sed -e "s|@MAX_BODY@|$max|g" -e "s|@MAX_BATCH_BODY@|$batch|g" -e "s|@UPSTREAM@|$upstream|g" \
  -e "s|@RESOLVER@|$resolver|g" -e "s|@HSTS@|$hsts|g" \
  /etc/nginx/worldcup.conf.template > /etc/nginx/nginx.conf
exec "$@"
